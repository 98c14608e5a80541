"""PPO pieces that need no model: config checks, the Experience contract, sampling draws, the NaN guard."""

import pytest
import torch

from megatron_rlhf.config import schema as C
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.config.ppo import check_ppo_layout
from megatron_rlhf.trainer.ppo.eval import sample_panel, summary, uniforms
from megatron_rlhf.trainer.ppo.learn import SkipGuard, TrainingDiverged

BASE = ["data.train_path=/etc/hosts", "tokenizer.path=/tmp", "model.load=/tmp", "ppo.reward_load=/tmp",
        "data.max_prompt_len=16", "model.max_position_embeddings=128"]


def load(*overrides):
    return C.load_config(C.PPOConfig, None, [*BASE, *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["ppo.reward_load=null"], "ppo.reward_load is not set"),
    (["ppo.rollout_batch_size=100", "ppo.minibatch_size=64"], "multiple of ppo.minibatch_size=64"),
    (["ppo.max_new_tokens=200"], "exceeds model.max_position_embeddings=128"),
    (["ppo.gold_scorer=nocolon"], "'module:function'"),
    (["ppo.value_warmup_iterations=100", "ppo.iterations=100"], "ppo.value_warmup_iterations=100"),
    (["ppo.kl_estimator=k4"], "ppo.kl_estimator='k4' is not one of"),
    (["ppo.doctor.entropy_fraction=-1"], "ppo.doctor.entropy_fraction=-1.0"),
    (["ppo.top_p=0"], "ppo.top_p=0.0 must be in (0, 1]"),
    (["ppo.top_k=-2"], "ppo.top_k=-2 must be >= 0"),
])
def test_bad_ppo_settings_fail_with_one_line(overrides, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load(*overrides)
    assert "\n" not in str(e.value)


def test_layout_checks_name_the_fix():
    cfg = load("ppo.minibatch_size=64", "train.micro_batch_size=64")
    check_ppo_layout(cfg, 1)
    with pytest.raises(C.ConfigError, match=r"ppo.minibatch_size=64 is not divisible by .* 2\*64"):
        check_ppo_layout(cfg, 2)
    check_ppo_layout(load("parallel.pp=2"), 1)  # generation runs in its own tp-only layout (rollout.tp)
    with pytest.raises(C.ConfigError, match="parallel.cp=2"):
        check_ppo_layout(load("parallel.cp=2"), 1)
    with pytest.raises(C.ConfigError, match="rollout.tp=3 does not divide the world size 2"):
        check_ppo_layout(load("rollout.tp=3", "train.micro_batch_size=32"), 2)
    with pytest.raises(C.ConfigError, match="ppo.temperature=2.5: vLLM samples at temperatures up to 2"):
        check_ppo_layout(load("rollout.engine=vllm", "ppo.temperature=2.5"), 1)
    with pytest.raises(C.ConfigError, match="rollout.vllm.kv_cache_gib=-1"):
        check_ppo_layout(load("rollout.engine=vllm", "rollout.vllm.kv_cache_gib=-1"), 1)
    assert load().train.global_batch_size  # the SFT batch keys do not constrain PPO


def _experience():
    gen = {"response_ids": torch.tensor([[5, 2, 0], [6, 7, 8]]), "response_mask": torch.tensor([[1., 1, 0], [1, 1, 1]]),
           "logprobs": torch.zeros(2, 3), "ended": torch.tensor([True, False]), "lengths": torch.tensor([2, 3])}
    return build_experience([[1, 3, 4], [1]], gen, pad_id=0)


def test_experience_positions_rows_and_microbatches():
    exp = _experience()
    assert exp.input_ids.tolist() == [[1, 3, 4, 5, 2], [1, 6, 7, 8, 0]]
    # response token k of row i is predicted at position p_i - 1 + k
    assert exp.response_index().tolist() == [[2, 3, 4], [0, 1, 2]]
    assert exp.sequence_lengths.tolist() == [5, 4]
    second = exp.rows([1])
    assert second.input_ids.tolist() == [[1, 6, 7, 8]]  # trimmed to its own longest sequence
    mbs = exp.microbatches(1)
    assert len(mbs) == 2 and mbs[1]["response_index"].tolist() == [[0, 1, 2]]
    assert "logprobs" not in mbs[0]  # unset fields are not passed on


def test_sampling_draws_depend_on_seed_and_iteration_only():
    whole = uniforms(7, 3, slice(0, 8), 8, 5)
    assert torch.equal(torch.cat([uniforms(7, 3, slice(0, 4), 8, 5), uniforms(7, 3, slice(4, 8), 8, 5)]), whole)
    assert not torch.equal(uniforms(7, 4, slice(0, 8), 8, 5), whole)
    assert ((whole >= 0) & (whole < 1)).all()


def test_skip_guard_counts_each_model_in_a_row():
    logs = []
    guard = SkipGuard(2, logs.append)
    guard.record("policy", 1, {"skipped": 1.0})
    guard.record("value", 1, {"skipped": 0.0})  # the other model's good step does not reset the policy's count
    with pytest.raises(TrainingDiverged, match="2 policy optimizer steps in a row"):
        guard.record("policy", 2, {"skipped": 1.0})
    guard = SkipGuard(2)
    for step, skipped in enumerate([1.0, 0.0, 1.0, 0.0]):
        guard.record("policy", step, {"skipped": skipped})  # never two in a row: no error
    assert "policy step 1: NaN/Inf" in logs[0]


def test_summary_and_sample_panel():
    s = summary({"eval/gold_score": 0.7, "eval/rm_score": 0.0}, {"eval/gold_score": 0.9, "eval/rm_score": 1.0,
                                                                   "eval/kl": 2.0}, {"iterations": 5})
    assert (s["true_reward_sft"], s["true_reward_ppo"], s["rm_reward_ppo"], s["kl_ppo"]) == (0.7, 0.9, 1.0, 2.0)

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))

    exp = _experience()
    exp.rm_scores = torch.tensor([0.5, -1.0])
    panel = sample_panel(exp, Tok(), lambda prompts, responses: [len(r) for r in responses])
    assert panel.splitlines()[1] == "3 4 | 5 2 | 0.500 | 3.000"


def test_sample_rows_and_append_jsonl_write_samples_jsonl(tmp_path):
    """The held-out samples of an eval as samples.jsonl rows (the run report's table): texts as `texts` gives
    them, the RM and gold scores; a NaN score is written as null (the file stays JSON)."""
    import json

    from megatron_rlhf.trainer.ppo.eval import sample_rows
    from megatron_rlhf.trainer.run import append_jsonl

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))

    exp = _experience()
    exp.rm_scores = torch.tensor([0.5, float("nan")])
    rows = sample_rows(exp, Tok(), torch.tensor([3.0, 1.0]), rows=8)
    assert rows == [{"prompt": "3 4", "response": "5 2", "rm_score": 0.5, "gold_score": 3.0},
                    {"prompt": "", "response": "6 7 8", "rm_score": rows[1]["rm_score"], "gold_score": 1.0}]
    assert sample_rows(exp, Tok(), None, rows=1) == [{"prompt": "3 4", "response": "5 2", "rm_score": 0.5,
                                                      "gold_score": None}]
    path = tmp_path / "samples.jsonl"
    append_jsonl(str(path), [{"iteration": 0, **r} for r in rows])
    append_jsonl(str(path), [{"iteration": 4, **rows[0]}])
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in written] == [0, 0, 4] and written[1]["rm_score"] is None
