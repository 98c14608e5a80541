"""Stop signals on the real cluster, whatever their source and moment: SIGUSR1 mid-run (`scancel --signal`), the
time limit's own SIGUSR1 (`--signal=USR1@N`), Slurm's requeue (SIGTERM, as PreemptMode=REQUEUE
sends it), a stop during start-up and one after the final checkpoint. Each job ends COMPLETED with every
per-step metric bit-identical to the uninterrupted local run; a stopped job was checkpointed, requeued and
resumed (Restarts >= 1) and wrote one log across its restarts."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

from tests.slurm.cluster import cluster_yaml, wait_for
from tests.slurm.stages import LONG_STEPS, assert_same_metrics, run_dir, run_local, sft_config, step_metrics


def _submit(slurm, tiny, tmp_path, name="long", steps=LONG_STEPS, **cluster):
    config = sft_config(tiny["data"], tmp_path, name, **{"train.train_steps": steps})
    yaml = cluster_yaml(tmp_path / "cluster.yaml", tmp_path / "logs", **cluster)
    return slurm.submit("sft", config, cluster_yaml=yaml), run_dir(config)


def _steps_done(run, n):
    return lambda: (run / "metrics.jsonl").exists() and len(step_metrics(run)) >= n


def _resumed_exactly(slurm, job, run, reference, stopped_by):
    """COMPLETED after >= 1 requeue, one log holding every restart, and the uninterrupted run's metrics."""
    info = slurm.wait_final(job, timeout=400)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED", (info, log[-4000:])
    assert int(info["Restarts"]) >= 1, (info, log[-4000:])
    assert f"SIG{stopped_by} -> every rank saves a checkpoint" in log, log[-4000:]
    stops = re.findall(r"stop requested: saved checkpoint at step (\d+)", log)
    assert stops and f"requeueing job {job} to resume" in log, log[-4000:]
    for restart in range(int(info["Restarts"]) + 1):  # --open-mode=append: the same file for every run
        assert f"job {job} restart {restart}" in log, log[-4000:]
    assert "resumed from" in log, log[-4000:]
    assert_same_metrics(run, run_dir(reference))
    return [int(s) for s in stops]


def test_sigusr1_mid_run(slurm, tiny, tmp_path):
    job, run = _submit(slurm, tiny, tmp_path)
    wait_for(_steps_done(run, 5), 300, "5 steps")
    slurm.run("scancel", "--signal=USR1", job)  # as a preemption warning reaches the job's tasks
    stops = _resumed_exactly(slurm, job, run, tiny["long"], "USR1")
    assert 5 <= stops[0] < LONG_STEPS, stops


def test_the_time_limits_own_signal(slurm, tiny, tmp_path):
    """`--signal=USR1@100` and a time limit that comes near: slurmctld sends the SIGUSR1 at its next time-limit test
    (every 30 s). The job starts with a 10-minute limit that is cut to 2 minutes once its ranks are up: a warning
    sent before `srun` has started the step reaches no task (it goes to the steps only, as the sbatch script asks)
    and is lost, by Slurm's design (config/cluster.py refuses a limit that short for a real job). The run (~35 s of
    steps) is still going when the signal comes, in start-up or mid-run. Once requeued, the job gets a longer limit:
    the rerun would otherwise be stopped again at its first test, which is the same path once more."""
    steps = 8 * LONG_STEPS  # ~35 s: longer than the 30 s the signal can take to come
    job, run = _submit(slurm, tiny, tmp_path, name="timed", steps=steps, signal_seconds=100)
    reference = sft_config(tiny["data"], tmp_path, "timed-local", **{"train.train_steps": steps})
    with ThreadPoolExecutor(1) as pool:
        local = pool.submit(run_local, "sft", reference)  # while the job runs
        wait_for(lambda: len(slurm.ranks(job)) >= 2, 120, "both ranks to start")
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=2")
        wait_for(lambda: int(slurm.job(job).get("Restarts", 0)) >= 1, 150, f"job {job} to be requeued by its limit")
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
        local.result()
    _resumed_exactly(slurm, job, run, reference, "USR1")


def test_slurms_own_requeue(slurm, tiny, tmp_path):
    """`scontrol requeue` (what a PreemptMode=REQUEUE preemption does): SIGTERM to every task, KillWait to
    exit, then the job starts again from the queue."""
    job, run = _submit(slurm, tiny, tmp_path)
    wait_for(_steps_done(run, 5), 300, "5 steps")
    slurm.run("scontrol", "requeue", job)
    _resumed_exactly(slurm, job, run, tiny["long"], "TERM")


def test_a_stop_during_start_up(slurm, tiny, tmp_path):
    """SIGUSR1 while the ranks import torch and build the model: the first step ends with a checkpoint, the job
    is requeued and resumed (the signal used to kill the ranks: exit 138, job FAILED)."""
    job, run = _submit(slurm, tiny, tmp_path, name="sft", steps=6)
    wait_for(lambda: len(slurm.ranks(job)) >= 2, 120, "both ranks to start")
    assert not (run / "metrics.jsonl").exists()  # still starting up
    slurm.run("scancel", "--signal=USR1", job)
    stops = _resumed_exactly(slurm, job, run, tiny["sft"], "USR1")
    assert stops[0] == 1, stops


def test_a_stop_after_the_final_checkpoint(slurm, tiny, tmp_path):
    """SIGUSR1, again and again, from the final checkpoint until the job has ended: nothing dies of it (a rank and
    the launcher used to, exit 138), nothing is requeued, the job is COMPLETED."""
    job, run = _submit(slurm, tiny, tmp_path, name="sft", steps=6)
    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.exists() and latest.read_text().strip() == "step_00000006", 300, "the final checkpoint")
    sent = 0
    while slurm.state(job) in ("RUNNING", "COMPLETING"):
        slurm.run("scancel", "--signal=USR1", job, check=False)
        sent += 1
        time.sleep(0.05)
    info = slurm.wait_final(job, timeout=120)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, sent, log[-4000:])
    assert "SIGUSR1 -> every rank saves a checkpoint" in log, (sent, log[-4000:])  # the signals did arrive
    assert "nothing to resume" in log and "requeueing" not in log, log[-4000:]
    assert_same_metrics(run, run_dir(tiny["sft"]))
