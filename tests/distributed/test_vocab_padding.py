"""Vocabulary padding takes no probability mass: vocab 17 pads to 18 at TP=2 and not at TP=1, and a
TP=2 SFT run resumed at TP=1/DP=2 continues the curve of the uninterrupted TP=2 run."""

from tests.distributed.test_training import data, losses, overrides, run_cli  # noqa: F401 (fixture)


def test_tp2_run_resumed_at_tp1_dp2_continues_the_same_curve(data, tmp_path):  # noqa: F811
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_cli("sft", overrides(data, straight, **{"parallel.tp": 2}), nproc=2)
    run_cli("sft", overrides(data, split, **{"parallel.tp": 2, "train.exit_at_step": 3}), nproc=2)
    proc = run_cli("sft", overrides(data, split, **{"parallel.tp": 1}), nproc=2)
    assert "at step 3" in proc.stdout
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):
        assert abs(a[s] - b[s]) < 1e-5, (s, a[s], b[s])
