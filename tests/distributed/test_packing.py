"""Packed micro-batches (models/packing.py) against padded ones in the trainer's PPO passes, on 2 ranks at TP=2
(sequence parallelism off and on: packs' widths then round up to the TP size) and PP=2: old log-probs, values,
reward scores, the policy and value losses and every gradient agree within 1e-6 (relative to each quantity's
scale), and no packed sequence reads another."""

import pytest

from tests.distributed.launch import read_json, torchrun


@pytest.mark.parametrize("tp, pp, sp", [(2, 1, 0), (2, 1, 1), (1, 2, 0)], ids=["tp2", "tp2_sp", "pp2"])
def test_packed_passes_equal_padded_and_do_not_leak(tmp_path, tp, pp, sp):
    out = tmp_path / "packing.json"
    torchrun("packing.py", out, tp, pp, sp)
    r = read_json(out)
    assert r["padding_fraction"] > 0.5  # most of the padded batch is padding: the comparison covers it
    for key in ("logprobs", "values", "scores", "policy_loss", "value_loss", "policy_grad_rel", "value_grad_rel"):
        assert r[key] <= 1e-6, (key, r[key])
    assert r["policy_grad_nonzero"] and r["value_grad_nonzero"]
    assert r["leak_others_equal"] and r["leak_changed_differs"]


def test_a_ppo_run_packed_logs_what_it_logs_padded(base, tmp_path):
    """3 iterations at DP=2 (value warm-up, then policy steps, an eval) with packing on, the default, and off:
    every logged learning metric agrees within 1e-5; packing changes only the GEMM shapes, not what is learned.
    Clip fractions count tokens on either side of a threshold, so one of some 700 tokens may flip (0.0014)."""
    from tests.distributed.launch import CLI
    from tests.distributed.test_ppo import learning_metrics, ppo_args, rows

    runs = {}
    for packed in ("true", "false"):
        run = tmp_path / f"packing_{packed}"
        torchrun(CLI, *ppo_args(base, run, **{"ppo.value_warmup_iterations": 1, "ppo.iterations": 3,
                                              "checkpoint.save_interval": 0, "train.packing": packed}),
                 nproc=2, timeout=600)
        runs[packed] = rows(run)
    packed, padded = runs["true"], runs["false"]
    assert sorted(packed) == sorted(padded) == [0, 1, 2, 3]
    compared = 0
    for step in padded:
        a, b = learning_metrics(packed[step]), learning_metrics(padded[step])
        assert sorted(a) == sorted(b), step
        for key, value in b.items():
            tol = dict(abs=0.005) if "clip_fraction" in key else dict(rel=1e-5, abs=1e-5)
            assert a[key] == pytest.approx(value, **tol), (step, key, a[key], value)
            compared += 1
    assert compared > 40 and packed[3]["ppo/kl_per_seq"] > 0  # the policy moved, the comparison covers it
    for step in (1, 2, 3):  # and the packed run packed: less of its forwards' work was padding
        assert packed[step]["perf/real_token_fraction"] > padded[step]["perf/real_token_fraction"] + 0.1, step
