"""One run per run directory, one stage per checkpoint directory, and no fresh start over old checkpoints.

- `lock_dir`: the first rank of a run holds an exclusive `flock` on `<dir>/.lock` for as long as it lives,
  and writes its host and pid into the file. A second run fails at start naming the holder. The kernel
  drops the lock when the holder dies (kill -9 included), so a lock left by a dead run is never in the way.
- `check_resumable`: a stage resumes only from checkpoints its own stage wrote (their `run.json`); an SFT
  checkpoint directory is never continued, repointed or pruned by PPO.
- `check_fresh_start`: a run that starts fresh in a directory that already holds `step_*` checkpoints would
  mix its steps with them; it is refused unless `checkpoint.overwrite=true`, which moves them aside first.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron_rlhf.checkpoint.damage import CheckpointError
from megatron_rlhf.checkpoint.record import RunRecord, read_run_record
from megatron_rlhf.checkpoint.state import LATEST

LOCK_FILE = ".lock"
_HELD: Dict[str, object] = {}  # resolved dir -> open lock file, kept open while this process lives


def lock_dir(path: str, key: str) -> Optional[str]:
    """Take the run lock of `path` (created if needed). None when taken (or already held by this process),
    else one line naming the run that holds it."""
    d = os.path.realpath(path)
    if d in _HELD:
        return None
    os.makedirs(d, exist_ok=True)
    f = open(os.path.join(d, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its name yet"
        f.close()
        return (f"{key}='{path}' is in use by another run ({holder}): wait for it to end, "
                f"or choose another {key}")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _HELD[d] = f
    return None


def release_all() -> None:
    """Drop this process's run locks (a process that runs several stages one after another)."""
    while _HELD:
        _, f = _HELD.popitem()
        f.close()


def step_dirs(root: Path) -> List[str]:
    """Names of the step_* directories under `root`, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def check_resumable(step_dir: Path, stage: str, key: str) -> Optional[RunRecord]:
    """The record of the checkpoint a `stage` run resumes from; CheckpointError if another stage wrote it."""
    record = read_run_record(step_dir)
    if record is not None and record.stage != stage:
        raise CheckpointError(
            f"{key}: {step_dir.parent} holds {record.stage} checkpoints ({step_dir.name}), not {stage} ones: "
            f"a {stage} run keeps its checkpoints apart (the {record.stage} checkpoint is read through "
            f"the keys that load models, e.g. model.load); choose another {key}")
    return record


def check_fresh_start(root: Path, stage: str, key: str, overwrite: bool, rank0: bool,
                      log: Optional[Callable[[str], None]]) -> None:
    """Before a fresh start in `root`: refuse if it holds checkpoints (another stage's always; this stage's
    unless `overwrite`, which moves them to `<root>/replaced-<time>/` on rank 0). Every rank calls it."""
    root = Path(root)
    names = step_dirs(root)
    if not names:
        return
    others = {r.stage for r in map(read_run_record, (root / n for n in names)) if r is not None and r.stage != stage}
    shown = ", ".join(names[-3:])
    if others:
        raise CheckpointError(
            f"{key}: {root} holds {'/'.join(sorted(others))} checkpoints ({shown}), not {stage} ones: "
            f"a {stage} run keeps its checkpoints apart; choose another {key}")
    if not overwrite:
        raise CheckpointError(
            f"{key}: {root} already holds checkpoints of an earlier run ({shown}) and this run starts fresh: "
            "its steps would mix with them; choose another " + key + ", resume with checkpoint.resume=auto, "
            "or set checkpoint.overwrite=true to move them aside")
    if rank0:
        aside = root / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for name in names + [LATEST]:
            if (root / name).exists():
                os.replace(root / name, aside / name)
        if log:
            log(f"checkpoint.overwrite: moved the earlier checkpoints of {root} to {aside}")
