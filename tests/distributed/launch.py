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

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTED_JOBS: list = []  # Job instances; conftest kills what is left of them after each test
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CLI = ROOT / "megatron_rlhf" / "cli.py"


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


def sigterm_when(cmd, log: Path, ready, timeout: int = 600):
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


class Job:
    """A launcher started in a session of its own; every descendant it ever had is remembered."""

    def __init__(self, cmd, log):
        self.log = log
        env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})  # for a world of one
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = {}
        STARTED_JOBS.append(self)  # killed with every descendant when the test ends (conftest), pass or fail

    def kill_all(self):
        """Kill the launcher and every descendant it ever had (after a failed assertion: no orphan trains on)."""
        self.watch()
        for p in [self.proc, *self.seen.values()]:
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass

    def watch(self):
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(c.pid, c)
        except psutil.Error:
            pass

    def wait_for(self, cond, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            self.watch()
            if cond():
                return
            time.sleep(0.2)
        pytest.fail(f"condition not met (rc={self.proc.poll()}):\n{self.output()[-3000:]}")

    def ranks(self):
        return [c for c in psutil.Process(self.proc.pid).children() if "megatron_rlhf" in " ".join(c.cmdline())]

    def finish(self, timeout=600):
        """Wait for the launcher and then for every remembered descendant, without killing any. The limits
        are generous (a loaded machine) and never waited out by a job that behaves: each wait ends at the event."""
        try:
            rc = self.proc.wait(timeout=timeout)
            deadline = time.time() + 120
            alive = [c for c in self.seen.values() if is_alive(c)]
            while alive and time.time() < deadline:
                time.sleep(0.5)
                alive = [c for c in alive if is_alive(c)]
            return rc, [cmdline_of(c) for c in alive]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for c in self.seen.values():
                try:
                    c.kill()
                except psutil.Error:
                    pass

    def output(self):
        return open(self.log).read()


def is_alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cmdline_of(p) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return str(p.pid)
