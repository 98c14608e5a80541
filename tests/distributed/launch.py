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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    """Run `cmd` in its own session and kill whatever it leaves behind.

    A rank killed with SIGKILL orphans the multiprocessing manager that Megatron's checkpointing
    spawns; it would hold the output pipes open (and a test waiting for EOF would hang), so output
    goes to files and the whole session is killed once the command has ended.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
