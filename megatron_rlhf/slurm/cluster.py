"""The cluster YAML of `slurm/launch.py`: where and how a stage runs on Slurm.

    account: my_account
    partition: batch
    nodes: 16
    gpus_per_node: 8
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

from megatron_rlhf.config.fields import ConfigError, help_field as _f


@dataclass
class SlurmCluster:
    account: Optional[str] = _f(None, "Slurm account (--account)")
    partition: Optional[str] = _f(None, "Slurm partition (--partition)")
    nodes: int = _f(1, "nodes (--nodes)")
    gpus_per_node: int = _f(8, "GPUs per node: ranks per node (--gpus-per-node)")
    gpu_memory_gib: float = _f(80.0, "memory of one GPU, for the planner")
    cpus_per_task: int = _f(96, "CPUs of the one task per node (--cpus-per-task)")
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
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def load_cluster(path: Optional[str], overrides: Sequence[str]) -> SlurmCluster:
    """Defaults <- YAML file <- `key=value` overrides, checked; ConfigError (one line) otherwise."""
    from megatron_rlhf.config import schema as C
    from megatron_rlhf.config import io as config_io

    cluster, _ = config_io.structured(SlurmCluster, path, overrides)
    C.validate(cluster)  # choices
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise ConfigError(f"nodes={cluster.nodes} and gpus_per_node={cluster.gpus_per_node} must be >= 1")
    if cluster.tunnel == "ssh" and not (cluster.ssh_host and cluster.ssh_user and cluster.remote_job_dir):
        raise ConfigError("tunnel=ssh needs ssh_host, ssh_user and remote_job_dir")
    return cluster
