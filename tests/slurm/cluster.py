"""A real Slurm cluster of two nodes on this host (slurm/local_cluster.sh) and what the tests do with it:
submit a stage through slurm/launch.py, read a job's state from `scontrol`, wait for events, find its ranks."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from tests.distributed.launch import ROOT, child_env

SCRIPT = ROOT / "slurm" / "local_cluster.sh"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
PACKAGES = "slurmctld slurmd slurm-client munge"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def missing_requirement():
    """None when a local cluster can run here, else one line saying what it needs."""
    if os.geteuid() != 0:
        return "tests/slurm need root: the local Slurm cluster's daemons run as SlurmUser=root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"tests/slurm need Debian's Slurm 22.05 ({', '.join(missing)} missing): "
                f"apt-get install -y --no-install-recommends {PACKAGES}")
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """The first of `n` consecutive free ports (slurmd's Port=[a-b] range must be contiguous)."""
    for base in range(21000 + (os.getpid() % 200) * 40, 60000, 40):
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(cond, timeout: float, what: str, every: float = 0.2):
    """Poll `cond()` until it returns something true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    """`nodes` Slurm nodes n1..nN on this host, up from `up()` until `down()`; every daemon stopped by its PID."""

    def __init__(self, directory: Path, nodes: int = 2):
        self.dir, self.nodes = directory, nodes
        base = free_port_block(nodes + 1)
        self.ports = list(range(base, base + nodes + 1))  # slurmctld, then one per slurmd
        self.conf = str(directory / "slurm.conf")
        self.env = {"CLUSTER_DIR": str(directory), "SLURMCTLD_PORT": str(base), "SLURMD_PORT": str(base + 1),
                    "SLURM_CONF": self.conf}

    def _script(self, *args, timeout=120):
        return subprocess.run(["bash", str(SCRIPT), *args], env=dict(os.environ, **self.env), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def up(self):
        proc = self._script("up", str(self.nodes))
        if proc.returncode != 0:
            raise RuntimeError(f"local_cluster.sh up failed: {proc.stderr.strip()}")

    def daemon_pids(self):
        pids = self.dir / "pids"
        return {p.name: int(p.read_text()) for p in pids.iterdir()} if pids.is_dir() else {}

    def down(self):
        """Cancel every job, stop the daemons by PID; returns what is still alive or listening (should be [])."""
        pids = self.daemon_pids()
        proc = self._script("down")
        left = [f"{name} (pid {pid})" for name, pid in pids.items() if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        left += [f"port {p}" for p in self.ports if listening(p)]
        if proc.returncode != 0:
            left.append(f"local_cluster.sh down: rc={proc.returncode} {proc.stderr.strip()}")
        return left

    # --- jobs ---------------------------------------------------------------------------------------------
    def run(self, *cmd, timeout=120, check=True):
        proc = subprocess.run(list(cmd), env=dict(os.environ, SLURM_CONF=self.conf), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
        return proc

    def job(self, job_id: str) -> dict:
        """`scontrol show job` of a job as {key: value} (JobState, Restarts, StdOut, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "?")

    def wait_final(self, job_id: str, timeout: float = 300) -> dict:
        """Wait until the job has ended for good (a requeued job passes through PENDING again)."""
        wait_for(lambda: self.state(job_id) in FINAL_STATES, timeout, f"job {job_id} to end ({self.job(job_id)})",
                 every=0.5)
        return self.job(job_id)

    def log(self, job_id: str) -> str:
        """The job's output; nemo-run's jobs keep their tasks' output in log-*_<id>_<restart>.out next to it."""
        path = Path(self.job(job_id).get("StdOut", "/nonexistent"))
        files = [path] + sorted(path.parent.glob(f"log-*_{job_id}_*.out"))
        return "".join(f.read_text() for f in files if f.is_file())

    def ranks(self, job_id: str):
        """This host's processes of the job that run a training rank (`megatron_rlhf.cli <stage>` under launch)."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if "megatron_rlhf.cli" not in (p.info["cmdline"] or []):
                continue
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("SLURM_JOB_ID") == job_id and "RANK" in env:  # the launcher has no RANK
                found.append(p)
        return found

    def cancel_all(self, timeout: float = 90):
        """End every job of the cluster (a test that failed must not leave one running into the next)."""
        self.run("scancel", "--user=root", check=False)
        wait_for(lambda: not self.run("squeue", "-h", "-o", "%i").stdout.strip() or None, timeout,
                 "every job to leave the queue")

    def submit(self, stage: str, config: Path, overrides=(), *, backend="plain", cluster_yaml: Path, sets=(),
               env=None, timeout=300) -> str:
        """`python slurm/launch.py STAGE CONFIG ... --cluster C --backend B`, as a user submits; -> job id."""
        cmd = [sys.executable, "slurm/launch.py", stage, str(config), *overrides, "--cluster", str(cluster_yaml),
               "--backend", backend, *[a for s in sets for a in ("--set", s)]]
        full_env = child_env({"SLURM_CONF": self.conf, "PYTHON": sys.executable, **(env or {})})
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        found = re.search(r"Submitted batch job (\d+)", proc.stdout + proc.stderr)
        if proc.returncode != 0 or not found:
            pytest.fail(f"submit failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return found.group(1)


def write_yaml(path: Path, values) -> Path:
    """A YAML file of `values` (a dict, or `key=value` strings as tests/distributed/stages.overrides gives)."""
    if not isinstance(values, dict):
        values = OmegaConf.to_container(OmegaConf.from_dotlist([str(a) for a in values]))
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(values)))
    return path


def cluster_yaml(path: Path, log_dir: Path, **extra) -> Path:
    """The cluster YAML of slurm/launch.py for the local cluster: 2 CPU nodes x 1 rank."""
    values = {"nodes": 2, "gpus_per_node": 0, "ranks_per_node": 1, "time": "00:10:00", "log_dir": str(log_dir),
              "master_port": free_port_block(1), "signal_seconds": 30, "workdir": str(ROOT)}
    values.update(extra)
    return write_yaml(path, values)
