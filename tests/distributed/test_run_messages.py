"""What a user sees from a CPU run under `megatron-rlhf launch` (issue 12): logging.log_interval
thins metrics.jsonl, a rerun of a finished run says so, and stderr holds no Megatron warning noise
(deprecations, CUDA_DEVICE_MAX_CONNECTIONS advice, rerun-state-machine messages)."""

import re
import sys

from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import child_env, run_reaped
from tests.distributed.launch import CLI
from tests.distributed.stages import overrides

NOISE = re.compile(r"Warning|warnings\.warn|RerunStateMachine|Rerun State Machine|CUDA_DEVICE_MAX_CONNECTIONS")


def _launch(args):
    env = child_env()
    env.pop("PYTHONWARNINGS")  # the tests' blanket "ignore" would hide the noise this test is about
    proc = run_reaped([sys.executable, str(CLI), "launch", "--nproc-per-node", "2", "sft", *args], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_log_interval_finished_rerun_and_quiet_stderr(data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    args = overrides(data, run, **{"parallel.tp": 2, "train.train_steps": 5, "logging.log_interval": 2,
                                   "checkpoint.save_interval": 3})
    first = _launch(args)
    rows = read_jsonl(str(run / "metrics.jsonl"))
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 5]  # every 2nd step and the last
    assert not NOISE.search(first.stderr), first.stderr[-3000:]
    # The last line says what the run trained and where (a Slurm job's log has no step line with the bar off).
    assert re.fullmatch(rf"sft: trained steps 1-5 of 5 in [0-9.]+ s; run directory {re.escape(str(run))}",
                        first.stdout.strip().splitlines()[-1]), first.stdout[-2000:]

    latest = (run / "checkpoints" / "latest").read_text()
    again = _launch(args)  # resumes from the final checkpoint: loads it, trains nothing
    assert "at step 5: the run is already finished (5 steps), nothing to train" in again.stdout, again.stdout
    assert again.stdout.strip().splitlines()[-1] == f"sft: trained no step: the run was already at step 5 of 5; " \
        f"run directory {run}", again.stdout[-2000:]
    assert len(read_jsonl(str(run / "metrics.jsonl"))) == len(rows)
    assert (run / "checkpoints" / "latest").read_text() == latest  # and keeps its checkpoint
    assert not NOISE.search(again.stderr), again.stderr[-3000:]
