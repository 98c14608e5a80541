"""The generated plain Slurm job, run for real on this machine under a stand-in `srun` and `scontrol`:
SIGUSR1 to the node's task (as Slurm's --signal sends it) reaches every rank through slurm/node.sh and
`megatron-rlhf launch`, a checkpoint is saved, the job exits 0 and node 0 requeues it."""

import os
import signal
import sys

import psutil
from omegaconf import OmegaConf

from megatron_rlhf.slurm import sbatch
from megatron_rlhf.slurm.cluster import load_cluster
from tests.distributed.launch import ROOT, Job, free_port
from tests.distributed.stages import losses, overrides
from tests.distributed.test_preemption import _steps

FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun on one node: drop the options, run the task in a session of its own (as slurmstepd does).
while [[ "$1" == -* ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
exec setsid -w "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "$2" >> "$REQUEUED" ;;
esac
"""


def _write(path, text):
    path.write_text(text)
    path.chmod(0o755)


def test_sigusr1_to_the_node_task_checkpoints_and_requeues(data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir / "srun", FAKE_SRUN)
    _write(bin_dir / "scontrol", FAKE_SCONTROL)
    config = tmp_path / "sft.yaml"
    args = overrides(data, run, **{"train.train_steps": 100000, "checkpoint.save_interval": 2})
    config.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist([str(a) for a in args])))
    cluster = load_cluster(None, ["nodes=1", "gpus_per_node=2", f"master_port={free_port()}", f"workdir={ROOT}"])
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch.render("sft", str(config), ["logging.log_interval=1"], cluster))
    env_extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node001", "SLURM_JOB_NUM_NODES": "1",
                 "REQUEUED": str(tmp_path / "requeued")}
    job = Job(["env", *[f"{k}={v}" for k, v in env_extra.items()], "bash", str(script)], tmp_path / "log")
    job.wait_for(_steps(run))
    task = next(p for p in psutil.Process(job.proc.pid).children(recursive=True)
                if "slurm/node.sh" in " ".join(p.cmdline()))
    # The ranks are the launcher's direct children (a rank's forked checkpoint writers share its command line).
    launcher = next(p for p in task.children(recursive=True) if "launch" in p.cmdline())
    ranks = [p for p in launcher.children() if "megatron_rlhf.cli" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    os.killpg(os.getpgid(task.pid), signal.SIGUSR1)  # Slurm signals the step's tasks, not the batch shell
    rc, alive = job.finish()
    out = job.output()
    assert rc == 0 and not alive, (rc, alive, out[-3000:])
    stopped = max(losses(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert out.count("stop requested: saved checkpoint") == 1, out[-3000:]
    assert "requeueing job 4242" in out and (tmp_path / "requeued").read_text().split() == ["4242"]
    assert "node 0/1" in out and ", 2 ranks, master 127.0.0.1:" in out
