"""Preemption whatever the launcher (issue 12): SIGUSR1 to the launcher's process group (as Slurm
sends it) or to the ranks themselves gives a checkpoint and exit 0 under `megatron-rlhf launch`;
under torchrun, which dies of a group SIGUSR1, the ranks still checkpoint and exit instead of
training on as orphans; after a `kill -9` of a rank no helper process of the job stays alive, and
`megatron-rlhf launch` says in one line which rank died and where a rerun resumes (no gloo traceback)."""

import os
import signal
import sys

import pytest

from tests.distributed.launch import CLI, Job, cmdline_of, free_port, is_alive
from tests.distributed.stages import losses, overrides


def _launch(data, run, log, launcher="launch", **extra):
    args = overrides(data, run, **{"train.train_steps": 100000, "checkpoint.save_interval": 2, **extra})
    if launcher == "launch":
        cmd = [sys.executable, str(CLI), "launch", "--nproc-per-node", "2", "sft", *args]
    elif launcher == "none":  # one task started directly, as srun starts each rank
        cmd = [sys.executable, str(CLI), "sft", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(CLI), "sft", *args]
    return Job(cmd, log)


def _steps(run):
    return lambda: (run / "metrics.jsonl").exists() and len(losses(run)) >= 3


@pytest.mark.parametrize("target", ["process_group", "ranks"])
def test_sigusr1_under_launch_saves_and_exits_zero(data, tmp_path, target):  # noqa: F811
    run = tmp_path / "run"
    job = _launch(data, run, tmp_path / "log")
    job.wait_for(_steps(run))
    if target == "process_group":
        os.killpg(job.proc.pid, signal.SIGUSR1)  # Slurm: every process of the step
    else:
        for rank in job.ranks():
            rank.send_signal(signal.SIGUSR1)
    rc, alive = job.finish()
    out = job.output()
    assert rc == 0 and not alive, (rc, alive, out[-3000:])
    stopped = max(losses(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert out.count("stop requested: saved checkpoint") == 1, out[-3000:]


def test_torchrun_killed_by_group_sigusr1_leaves_ranks_that_checkpoint_and_exit(data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    job = _launch(data, run, tmp_path / "log", launcher="torchrun")
    job.wait_for(_steps(run))
    os.killpg(job.proc.pid, signal.SIGUSR1)
    rc, alive = job.finish()
    assert rc == -signal.SIGUSR1  # torchrun does not handle SIGUSR1
    assert not alive, alive  # no rank trains on as an orphan
    stopped = max(losses(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert "stop requested: saved checkpoint" in job.output()


@pytest.mark.parametrize("launcher", [
    "none", "launch", "torchrun"])
def test_kill_9_of_a_rank_leaves_no_helper_behind(data, tmp_path, launcher):  # noqa: F811
    """Nothing a rank started outlives it, whoever started the rank ("none": nothing but the kernel can clean
    up after a rank started directly). Checkpoint writers forked by a save get SIGKILL with their rank, and
    there is no dist_checkpointing manager process (the write-results queue lives in the rank)."""
    run = tmp_path / "run"
    job = _launch(data, run, tmp_path / "log", launcher=launcher)
    job.wait_for(lambda: (run / "checkpoints" / "latest").exists())  # saves have forked their writers
    assert not any("multiprocessing" in cmdline_of(c) for c in job.seen.values() if is_alive(c))
    victim = job.proc if launcher == "none" else job.ranks()[-1]
    victim.kill()
    rc, alive = job.finish()
    assert rc != 0
    assert not alive, alive
    if launcher == "launch":  # it knows which rank died and how: one line, and where a rerun resumes
        latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        out = job.output()
        assert (f"error: rank 1 (pid {victim.pid}) was killed by SIGKILL; the job is ended, and a rerun resumes "
                f"from {latest}\n") in out, out[-3000:]
        assert out.count("error:") == 1 and "Traceback" not in out and "Connection reset" not in out, out[-3000:]
