"""A TP=2 SFT run stopped at step 3 resumes bit-exactly at TP=2, and a copy of it resumed at TP=1/DP=2
continues the same curve: vocabulary padding takes no probability mass (vocab 17 pads to 18 at TP=2, not
at TP=1). test_training.py covers exact resume at one rank (kill -9 test) and for the RM at PP=2."""

import shutil

from tests.distributed.stages import losses, overrides, run_cli


def test_tp2_resume_is_exact_and_continues_at_tp1_dp2(data, tmp_path):
    straight, split, regrouped = tmp_path / "straight", tmp_path / "split", tmp_path / "regrouped"
    run_cli("sft", overrides(data, straight, **{"parallel.tp": 2}), nproc=2)
    run_cli("sft", overrides(data, split, **{"parallel.tp": 2, "train.exit_at_step": 3}), nproc=2)
    assert losses(split).keys() == {1, 2, 3}
    shutil.copytree(split, regrouped)
    run_cli("sft", overrides(data, split, **{"parallel.tp": 2}), nproc=2)
    proc = run_cli("sft", overrides(data, regrouped, **{"parallel.tp": 1}), nproc=2)
    assert "at step 3" in proc.stdout
    a, b, c = losses(straight), losses(split), losses(regrouped)
    assert sorted(a) == sorted(b) == sorted(c) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit-exact on CPU
    for s in (4, 5, 6):  # another layout: the same curve up to fp32 summation order
        assert abs(a[s] - c[s]) < 1e-5, (s, a[s], c[s])
