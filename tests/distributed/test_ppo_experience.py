"""PPO experience (logprobs, reference logprobs, values, scores, shaped rewards) for a fixed batch of
generated tokens equals a plain one-sequence-at-a-time recomputation, at TP=1 and TP=2."""

import pytest

from tests.distributed.launch import read_json, torchrun


@pytest.mark.parametrize("tp", [1, 2])
def test_experience_matches_per_sequence_recomputation(tmp_path, tp):
    out = tmp_path / "experience.json"
    torchrun("ppo_experience.py", out, tp, nproc=tp)
    r = read_json(out)
    for key, diff in r["diffs"].items():
        assert diff <= 1e-5, (key, diff)  # fp32; includes zeros on padding
    # The comparison has teeth: policy and reference differ, and truncated rows got the penalty.
    assert r["kl_max_abs"] > 1e-2
    assert r["truncated_scores"] == [-1.0, -1.0]
    assert r["ended"] == [True, False, True, False, True]
    # Policy and reference from the same weights: logprobs equal exactly (KL exactly 0 on iteration 1).
    assert r["same_weights_equal"]
