"""Run a script under torchrun on N gloo ranks (CPU) and return its output; used by distributed tests.

Scripts live in tests/distributed/scripts/, write their results as JSON to a path they are given,
and must keep `if __name__ == "__main__":` (dist_checkpointing starts a spawn manager).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTED_JOBS: list = []  # test_preemption.Job instances; conftest kills what is left of them after each test
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict | None = None) -> dict:
    """Environment for child processes: the checkout importable, one thread, no CUDA, quiet warnings."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        CUDA_VISIBLE_DEVICES="",
    )
    env.update(extra or {})
    return env


def torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: int = 900, env: dict | None = None, check: bool = True
):
    """Run `script` (a path, or a name in tests/distributed/scripts) on `nproc` ranks.

    With `check` (default) a non-zero exit fails the test, showing the output's tail.
    """
    script = Path(script)
    if not script.is_absolute():
        script = SCRIPTS / script
    full_env = child_env(env)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(script), *map(str, args),
    ]
    proc = run_reaped(cmd, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"torchrun {script.name} {' '.join(map(str, args))} failed (rc={proc.returncode}):\n{out}")
    return proc


def run_reaped(cmd, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Run `cmd` and kill whatever it leaves behind.

    A rank killed with SIGKILL orphans the multiprocessing manager that Megatron's checkpointing
    spawns (torchrun starts ranks in sessions of their own, so a process-group kill misses it).
    Descendants are therefore recorded while the command runs and killed once it has ended, and
    output goes to files so that no orphan can hold a pipe of ours open.
    """
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        seen: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                _record_descendants(psutil, proc.pid, seen)
                time.sleep(0.2)
        finally:
            if proc.poll() is None:  # timed out: collect what is still attached
                _record_descendants(psutil, proc.pid, seen)
            _kill_all(psutil, proc, seen)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def _record_descendants(psutil, pid: int, seen: dict) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen[child.pid] = child  # psutil.Process remembers the create time: no PID-reuse accidents
    except psutil.Error:
        pass


def _kill_all(psutil, proc, seen: dict) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in seen.values():
        try:
            if child.is_running():
                child.kill()
        except psutil.Error:
            pass
    proc.wait()


def sigterm_when(cmd, log: Path, ready, timeout: int = 300):
    """Run `cmd` (a world of one, in a session of its own, output to `log`), send it SIGTERM once
    `ready()` holds, wait for it, then kill what is left of its session (checkpoint helpers).

    Returns (returncode, the log's text). Fails the test if the process ends before `ready()`.
    """
    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None and not ready():
            time.sleep(0.2)
        if proc.poll() is not None or not ready():
            pytest.fail(f"ended or timed out before it was ready (rc={proc.poll()}):\n{log.read_text()[-3000:]}")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, log.read_text()


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
