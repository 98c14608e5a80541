"""Which model of a checkpoint initialises which: an RM run's model.load is an SFT policy (its trunk, a fresh
head) or a reward model (trunk and head: a run that goes on from an RM); PPO's ppo.value_load is a reward model
or a PPO checkpoint, whose value model it then takes. Anything else is one line naming the setting. A world of
one rank, in process."""

import pytest
import torch

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer import rm
from tests.unit.test_checkpoint_damage import CFG


def _model(head: str, seed: int):
    """A model with every weight drawn, its scalar head too (which a build leaves at zero)."""
    torch.manual_seed(seed)
    chunks = build_model(ModelConfig(**CFG), ParallelConfig(), head=head)
    with torch.no_grad():
        chunks[0].output_layer.weight.normal_()
    return chunks


def _saved(root, **heads_and_seeds):
    """A checkpoint holding one model per name ({name: (head, seed)}); returns the models."""
    models = {name: _model(head, seed) for name, (head, seed) in heads_and_seeds.items()}
    ckpt.save_checkpoint(root, 1, models, {}, {}, {})
    return models


def _state(chunks):
    return {k: v for k, v in chunks[0].state_dict().items() if not k.endswith("_extra_state")}


def _equal(a, b, skip: str = "") -> bool:
    sa, sb = _state(a), _state(b)
    return all(torch.equal(sa[k], sb[k]) for k in sa if not (skip and k.startswith(skip)))


@pytest.mark.parametrize("source", ["policy", "reward"])
def test_an_rm_run_starts_from_a_policy_or_goes_on_from_a_reward_model(world, tmp_path, source):
    saved = _saved(tmp_path / source, **{source: ("lm" if source == "policy" else "scalar", 1)})[source]
    built = ckpt.load_model(tmp_path / source, ModelConfig(**CFG), ParallelConfig(), rm.STAGE.init_source, "scalar")
    assert _equal(saved, built, skip="output_layer")
    head = _state(built)["output_layer.weight"]
    if source == "reward":  # its head, trained
        assert torch.equal(head, _state(saved)["output_layer.weight"])
    else:  # a fresh scalar head (zero: every score 0 at the start)
        assert head.shape[0] == 1 and not head.any()


def test_a_ppo_checkpoint_as_value_load_gives_its_value_model(world, tmp_path):
    saved = _saved(tmp_path / "ppo", policy=("lm", 1), value=("scalar", 2))
    built = ckpt.load_model(tmp_path / "ppo", ModelConfig(**CFG), ParallelConfig(), ("value", "reward"), "scalar",
                            key="ppo.value_load")
    assert _equal(saved["value"], built)
    rm_dir = tmp_path / "rm"
    reward = _saved(rm_dir, reward=("scalar", 3))["reward"]  # and a reward model, as before
    assert _equal(reward, ckpt.load_model(rm_dir, ModelConfig(**CFG), ParallelConfig(), ("value", "reward"),
                                          "scalar", key="ppo.value_load"))


def test_a_policy_as_value_load_names_both_kinds_it_takes(world, tmp_path):
    _saved(tmp_path / "sft", policy=("lm", 1))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model(tmp_path / "sft", ModelConfig(**CFG), ParallelConfig(), ("value", "reward"), "scalar",
                        key="ppo.value_load")
    assert str(e.value) == (
        f"ppo.value_load: {tmp_path / 'sft' / 'step_00000001'} holds a policy (LM head), not a value model (scalar "
        "head) or a reward model (scalar head): point ppo.value_load at a PPO checkpoint (its value model) or a "
        "reward-model checkpoint (stage 2 output)")
