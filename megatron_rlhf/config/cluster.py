"""The cluster YAML of `slurm/launch.py`: where and how a stage runs on Slurm.

    account: my_account
    partition: batch
    nodes: 16
    gpus_per_node: 8                                   # 0 on a CPU partition, with ranks_per_node: N
    gpu_memory_gib: 80
    time: "04:00:00"
    container_image: nvcr.io/nvidia/pytorch:25.01-py3   # pyxis/enroot; null = no container
    container_mounts: [/lustre/data:/data]
    tunnel: local                                      # or ssh (ssh_host, ssh_user, remote_job_dir)

Loaded like a run config: YAML <- `key=value` overrides, unknown keys and wrong types are one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron_rlhf.config import io as config_io
from megatron_rlhf.config import schema as C
from megatron_rlhf.config.fields import ConfigError, help_field as _f


@dataclass
class SlurmCluster:
    account: Optional[str] = _f(None, "Slurm account (--account)")
    partition: Optional[str] = _f(None, "Slurm partition (--partition)")
    nodes: int = _f(1, "nodes (--nodes)")
    gpus_per_node: int = _f(8, "GPUs per node (--gpus-per-node); 0: a CPU partition (no gres/gpu), see ranks_per_node")
    ranks_per_node: Optional[int] = _f(None, "ranks per node; null = gpus_per_node (one rank per GPU)")
    gpu_memory_gib: float = _f(80.0, "memory of one GPU (of one CPU rank with gpus_per_node=0), for the planner")
    cpus_per_task: Optional[int] = _f(None, "CPUs of the one task per node (--cpus-per-task); null = all CPUs of "
                                      "a node (sinfo at submit time); checked against sinfo when given")
    time: str = _f("04:00:00", "time limit (--time)")
    job_name: str = _f("megatron-rlhf", "job name (--job-name)")
    log_dir: str = _f("logs", "directory of the per-job logs: <log_dir>/<job name>-<job id>.out")
    signal_seconds: int = _f(300, "SIGUSR1 this many seconds before the time limit: checkpoint, requeue")
    requeue: bool = _f(True, "--requeue: preempted or time-limited jobs start again and resume")
    master_port: int = _f(29500, "rendezvous port on the first node")
    container_image: Optional[str] = _f(None, "pyxis/enroot image (srun --container-image); null = none")
    container_mounts: List[str] = _f(help="pyxis mounts SRC:DST", factory=list)
    env_file: str = _f("slurm/env.sh", "site settings sourced by the job (NCCL, modules, paths)")
    workdir: Optional[str] = _f(None, "directory the job runs in (the checkout on the cluster); null = submit dir")
    tunnel: str = _f("local", "submit from this machine (local) or over SSH (ssh)", choices=("local", "ssh"))
    ssh_host: Optional[str] = _f(None, "login node for tunnel=ssh")
    ssh_user: Optional[str] = _f(None, "user for tunnel=ssh")
    remote_job_dir: Optional[str] = _f(None, "nemo-run job directory on the cluster (tunnel=ssh)")

    @property
    def ranks(self) -> int:
        """Ranks per node: one per GPU, or `ranks_per_node` (CPU partitions)."""
        return self.gpus_per_node if self.ranks_per_node is None else self.ranks_per_node

    @property
    def world(self) -> int:
        return self.nodes * self.ranks


def load_cluster(path: Optional[str], overrides: Sequence[str]) -> SlurmCluster:
    """Defaults <- YAML file <- `key=value` overrides, checked; ConfigError (one line) otherwise."""
    cluster, _ = config_io.structured(SlurmCluster, path, overrides)
    C.validate(cluster)  # choices
    if cluster.nodes < 1 or cluster.gpus_per_node < 0:
        raise ConfigError(f"nodes={cluster.nodes} must be >= 1 and gpus_per_node={cluster.gpus_per_node} >= 0")
    if cluster.ranks < 1:
        raise ConfigError("gpus_per_node=0 (a CPU partition) needs ranks_per_node >= 1: the ranks each node runs")
    if cluster.cpus_per_task is not None and cluster.cpus_per_task < 1:
        raise ConfigError(f"cpus_per_task={cluster.cpus_per_task} must be >= 1 (or null: all CPUs of a node)")
    if cluster.tunnel == "ssh" and not (cluster.ssh_host and cluster.ssh_user and cluster.remote_job_dir):
        raise ConfigError("tunnel=ssh needs ssh_host, ssh_user and remote_job_dir")
    _check_signal_time(cluster)
    return cluster


# slurmctld tests time limits, and sends `--signal` warnings, every 30 s (PERIODIC_TIMEOUT): a warning is sent at the
# first test at which the time left is within signal_seconds + 30 s.
_SLURM_LIMIT_CHECK_S = 30


def slurm_time_seconds(value: str) -> Optional[int]:
    """Slurm's --time (`M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`) in seconds; None for no limit.

    ConfigError (one line) for anything else."""
    text = str(value).strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    days, _, clock = text.rpartition("-")  # no "-": days == ""
    parts = clock.split(":")
    if not (days.isdigit() or "-" not in text) or not all(p.isdigit() for p in parts) or len(parts) > 3:
        raise ConfigError(f"time={value!r} is not a Slurm time limit: use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
    numbers = [int(p) for p in parts]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (numbers + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(numbers) == 1:  # minutes
        return numbers[0] * 60
    if len(numbers) == 2:  # minutes:seconds
        return numbers[0] * 60 + numbers[1]
    return (numbers[0] * 60 + numbers[1]) * 60 + numbers[2]


def _check_signal_time(cluster: SlurmCluster) -> None:
    """The time limit must leave the SIGUSR1 warning its moment. Slurm sends it at a 30-s time-limit test, to the
    job's steps only (`--signal` without `B:`): with too short a limit it goes out at the job's first test, possibly
    before `srun` has started the step, and is lost: the job then runs into its limit and is killed unsaved."""
    if cluster.signal_seconds < 0:
        raise ConfigError(f"signal_seconds={cluster.signal_seconds} must be >= 0 (SIGUSR1 that long before the limit)")
    limit = slurm_time_seconds(cluster.time)
    if limit is not None and limit < cluster.signal_seconds + 2 * _SLURM_LIMIT_CHECK_S:
        raise ConfigError(
            f"time={cluster.time} ({limit} s) leaves no room for signal_seconds={cluster.signal_seconds}: Slurm "
            f"sends SIGUSR1 at its time-limit test (every {_SLURM_LIMIT_CHECK_S} s), and sent before the job's step "
            f"has started it is lost; make time at least signal_seconds + {2 * _SLURM_LIMIT_CHECK_S} s")
