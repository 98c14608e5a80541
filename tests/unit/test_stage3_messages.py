"""Stage-3 inputs that used to be silently wrong or blamed on the wrong thing (issue 22): the reward
calibration is checked where it is loaded (item 7), a step without common.pt is named (item 14) and
ppo.beta=inf is refused as a setting. A world of one rank, in process."""

import pytest

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config import model_file
from megatron_rlhf.config import schema as C
from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.parallel import megatron_version
from megatron_rlhf.trainer.ppo.models import reward_calibration
from tests.unit.test_checkpoint_damage import _models


def _rm_checkpoint(root, calibration):
    ckpt.save_checkpoint(root, 2, {"reward": _models()["policy"]}, {}, {}, {"reward_calibration": calibration},
                         run=ckpt.RunRecord.new("rm"))
    return root


@pytest.mark.parametrize("calibration, said", [
    ({"mean": 0.3, "std": 0.0}, "has std=0.0: the reward model gives every sample the same score"),
    ({"mean": float("nan"), "std": 0.4}, "has mean=nan"),
    ({"mean": 0.3}, "has no std"),
    ({"mean": "x", "std": 1.0}, "has mean='x', not a number"),
])
def test_a_bad_reward_calibration_is_named_where_it_is_loaded(world, tmp_path, calibration, said):
    root = _rm_checkpoint(tmp_path / "rm", calibration)
    with pytest.raises(ckpt.CheckpointError) as e:
        reward_calibration(str(root))
    step = root / "step_00000002"
    where = step / "common.pt" if megatron_version.common_state_file() else step  # 0.19: inside the shards
    assert str(e.value).startswith(f"the reward calibration in {where} {said}"), e.value
    assert "ppo.normalize_reward=false" in str(e.value)


def test_a_good_calibration_loads(world, tmp_path):
    assert reward_calibration(str(_rm_checkpoint(tmp_path / "rm", {"mean": 0.3, "std": 0.5}))) == {"mean": 0.3,
                                                                                                     "std": 0.5}


@pytest.mark.skipif(not megatron_version.common_state_file(), reason="megatron-core 0.19 writes no common.pt")
def test_a_step_without_common_pt_is_named(world, tmp_path):
    root = _rm_checkpoint(tmp_path / "rm", {"mean": 0.3, "std": 0.5})
    (root / "step_00000002" / "common.pt").unlink()
    with pytest.raises(ckpt.CheckpointError) as e:
        reward_calibration(str(root))
    assert "common.pt" in str(e.value) and "iterdir" not in str(e.value), e.value
    assert str(e.value).startswith(f"checkpoint {root / 'step_00000002'} is damaged (common.pt: missing)"), e.value


def test_beta_inf_is_refused_as_a_setting():
    from megatron_rlhf.config.ppo import validate_ppo

    cfg = C.PPOConfig()
    cfg.ppo.beta, cfg.ppo.reward_load, cfg.model.load = float("inf"), "rm", "sft"
    with pytest.raises(ConfigError, match=r"ppo.beta=inf must be a finite number >= 0"):
        validate_ppo(cfg)


def _scalar_model():
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.models.spec import ModelConfig
    from megatron_rlhf.parallel.layout import ParallelConfig
    from tests.unit.test_checkpoint_damage import CFG

    return build_model(ModelConfig(**CFG), ParallelConfig(), head="scalar")


def test_an_lm_checkpoint_where_a_reward_model_belongs_names_the_key_and_the_head(world, tmp_path):
    sft = tmp_path / "sft"
    ckpt.save_checkpoint(sft, 2, _models(), {}, {}, {}, run=ckpt.RunRecord.new("sft"))
    for key, expected in ((None, "ppo.reward_load"), ("ppo.value_load", "ppo.value_load")):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load_model_weights(sft, _scalar_model(), "reward", "scalar", key=key)
        assert str(e.value) == (f"{expected}: {sft / 'step_00000002'} holds a policy (LM head), not a reward model "
                                f"(scalar head): point {expected} at a reward-model checkpoint (stage 2 output)")
    rm = _rm_checkpoint(tmp_path / "rm", {"mean": 0.0, "std": 1.0})  # and the reverse: an RM as model.load
    with pytest.raises(ckpt.CheckpointError, match=r"^model.load: .* holds a reward model \(scalar head\), not a "
                                                     r"policy \(LM head\): point model.load at an SFT"):
        ckpt.load_model_weights(rm, _models()["policy"], "policy", "lm")


def test_a_reward_model_of_another_size_takes_its_own_architecture_and_must_fit_the_layout(tmp_path):
    """Issue 45 item 1: the reward model (and the critic it starts) is built from the architecture its checkpoint
    records; one that does not divide the layout it runs in, or reads other tokens, is one line naming the numbers."""
    from megatron_rlhf.config.stage_models import check_other_models, other_models
    from megatron_rlhf.models.spec import ModelConfig
    from tests.unit.test_checkpoint_damage import CFG

    model_file.write_model_config(ModelConfig(**{**CFG, "hidden_size": 48, "ffn_hidden_size": 96, "num_layers": 3,
                                                 "num_attention_heads": 6, "num_query_groups": 3}), str(tmp_path / "rm"))
    cfg = C.PPOConfig()
    for k, v in CFG.items():
        setattr(cfg.model, k, v)
    cfg.ppo.reward_load = str(tmp_path / "rm")
    check_other_models(cfg)  # part of the PPO config check (schema.validate)
    arch = {m.name: m.arch for m in other_models(cfg)}
    assert (arch["reward"].hidden_size, arch["reward"].num_layers) == (48, 3) and arch["value"] == arch["reward"]
    assert arch["reference"] == cfg.model.to_model_config()  # model.load's: the policy's own
    cfg.parallel.pp = 2
    with pytest.raises(ConfigError) as e:
        check_other_models(cfg)
    assert str(e.value) == (f"the reward model (ppo.reward_load={tmp_path / 'rm'}) runs (ppo.inference_tp unset) in "
                            "the policy's layout: num_layers=3 is not divisible by pp=2: pick a pipeline size that "
                            "divides 3"), e.value
    cfg.ppo.inference_tp = 1  # its own layout (PP=1) takes 3 layers; the critic still trains at pp=2
    with pytest.raises(ConfigError, match=r"^the value model \(ppo.reward_load=.*\) trains in the policy's layout: "
                                          r"num_layers=3 is not divisible by pp=2"):
        check_other_models(cfg, world=4)
    cfg.parallel.pp, cfg.ppo.inference_tp = 1, 2
    with pytest.raises(ConfigError, match=r"^the reward model \(ppo.reward_load=.*\): ppo.inference_tp=2 does not "
                                          r"divide model.num_attention_heads=6 and model.num_query_groups=3"):
        check_other_models(cfg, world=2)
    cfg.ppo.inference_tp = None
    model_file.write_model_config(ModelConfig(**{**CFG, "vocab_size": CFG["vocab_size"] + 1}), str(tmp_path / "v"))
    cfg.ppo.value_load = str(tmp_path / "v")
    with pytest.raises(ConfigError, match=rf"^the value model \(ppo.value_load=.*\) has vocab_size="
                                          rf"{CFG['vocab_size'] + 1} but the policy has {CFG['vocab_size']}: a value "
                                          r"model scores the policy's own tokens"):
        check_other_models(cfg)


def test_dpo_pairs_that_differ_only_in_whitespace_are_bad_rows(tmp_path):
    """Item 10: such a pair tokenises identically (loss ln 2, nothing to learn); compared by token ids."""
    from megatron_rlhf.data import dataset as D
    from megatron_rlhf.data import tokenizer as T
    from megatron_rlhf.tasks import sort_digits

    sort_digits.save_tokenizer(str(tmp_path / "tok"))
    tok = T.load_tokenizer(str(tmp_path / "tok"))
    rows = [{"prompt": "sort 2 1 =", "chosen": "1 2", "rejected": "2 1"},
            {"prompt": "sort 2 1 =", "chosen": "1 2", "rejected": " 1  2 "}]
    (tmp_path / "p.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    data = C.DataConfig(max_seq_len=24, max_bad_fraction=1.0)
    ds, report = D.load_examples("preference", data, tok, str(tmp_path / "p.jsonl"), log=None)
    assert len(ds) == 1 and report.bad == {"chosen equals rejected once tokenized": 1}, report.bad


def test_a_reference_load_with_the_swapped_reference_is_refused():
    from megatron_rlhf.config.ppo import reference_source, validate_ppo

    cfg = C.PPOConfig()
    cfg.ppo.reward_load, cfg.model.load = "rm", "ppo/checkpoints"
    cfg.model.max_position_embeddings = 1024  # room for the default prompt and response lengths
    assert reference_source(cfg) == ("ppo/checkpoints", "model.load")
    cfg.ppo.reference_load = "sft"
    assert reference_source(cfg) == ("sft", "ppo.reference_load")
    validate_ppo(cfg)
    cfg.ppo.reference_mode = "swap"
    with pytest.raises(ConfigError, match=r"^ppo.reference_load with ppo.reference_mode=swap: the swapped reference "
                                          r"is the policy's initial weights \(model.load\); set "
                                          r"ppo.reference_mode=separate or remove ppo.reference_load$"):
        validate_ppo(cfg)


def test_a_reference_of_another_size_is_built_with_its_own_architecture(tmp_path):
    from megatron_rlhf.config.stage_models import check_other_models, other_models
    from megatron_rlhf.models.spec import ModelConfig
    from tests.unit.test_checkpoint_damage import CFG

    model_file.write_model_config(ModelConfig(**{**CFG, "num_layers": 4}), str(tmp_path / "sft"))
    cfg = C.PPOConfig()
    for k, v in CFG.items():
        setattr(cfg.model, k, v)
    cfg.ppo.reference_load = str(tmp_path / "sft")
    check_other_models(cfg)
    [reference] = [m for m in other_models(cfg) if m.name == "reference"]
    assert reference.key == "ppo.reference_load" and reference.arch.num_layers == 4 and not reference.trained
    model_file.write_model_config(ModelConfig(**{**CFG, "max_position_embeddings": 8}), str(tmp_path / "short"))
    cfg.ppo.reference_load = str(tmp_path / "short")
    with pytest.raises(ConfigError, match=r"^the reference model \(ppo.reference_load=.*\) has "
                                          r"max_position_embeddings=8, fewer than a prompt and its response"):
        check_other_models(cfg)

def test_reward_hf_config_states_the_architecture_and_must_agree_with_the_checkpoint(tmp_path):
    """Planning away from the cluster: ppo.reward_hf_config gives the reward model's shape; where the checkpoint is
    readable too, the two must agree (one line naming the numbers)."""
    import os

    from megatron_rlhf.config.stage_models import other_models
    from megatron_rlhf.models.spec import ModelConfig
    from tests.unit.test_checkpoint_damage import CFG

    hf = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "llama3_8b_config.json")
    cfg = C.PPOConfig()
    for k, v in CFG.items():
        setattr(cfg.model, k, v)
    cfg.ppo.reward_load, cfg.ppo.reward_hf_config = "/cluster/only/rm", hf
    arch = {m.name: m.arch for m in other_models(cfg)}
    assert (arch["reward"].num_layers, arch["reward"].hidden_size, arch["value"].ffn_hidden_size) == (32, 4096, 14336)
    assert arch["reward"].params_dtype == cfg.model.params_dtype  # the run's dtype, not the file's
    model_file.write_model_config(ModelConfig(**{**CFG, "vocab_size": 128256}), str(tmp_path / "rm"))
    cfg.ppo.reward_load = str(tmp_path / "rm")
    with pytest.raises(ConfigError, match=r"^ppo.reward_hf_config \(.*llama3_8b_config.json\) has num_layers=32, "
                                          r"hidden_size=4096, .* but the reward model in .*rm has num_layers=2, "
                                          r"hidden_size=32, .*: remove ppo.reward_hf_config or point it at"):
        other_models(cfg)
