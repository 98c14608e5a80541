"""Run a script under torchrun on N gloo ranks (CPU) and return its output; used by distributed tests.

Scripts live in tests/distributed/scripts/, write their results as JSON to a path they are given,
and must keep `if __name__ == "__main__":` (dist_checkpointing starts a spawn manager).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: int = 900, env: dict | None = None):
    """Run `script` (a path, or a name in tests/distributed/scripts) on `nproc` ranks; fail the test on error."""
    script = Path(script)
    if not script.is_absolute():
        script = SCRIPTS / script
    full_env = dict(os.environ)
    full_env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        CUDA_VISIBLE_DEVICES="",
    )
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(script), *map(str, args),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"torchrun {script.name} {' '.join(map(str, args))} failed (rc={proc.returncode}):\n{out}")
    return proc


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
