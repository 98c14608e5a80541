"""Telling a damaged checkpoint from one of another model, in one line that says what to do.

Megatron/torch report a truncated `.distcp` shard or a shape mismatch as a `CheckpointException`,
which derives from `BaseException` (an `except Exception` misses it) and whose text is a multi-rank
traceback. `unusable_checkpoint_message` digs out the root cause and names the checkpoint, the
older ones next to it and how to use them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import torch

from megatron_rlhf.parallel import megatron_version
from megatron_rlhf.parallel.report import first_problem

# Root causes that mean "another architecture", not "damaged files".
_MISMATCH = ("shape mismatch", "missing key", "unexpected key", "not in the checkpoint", "missing keys")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what to do."""


def _load_failures() -> tuple:
    """What `dist_checkpointing.load` raises for unusable files (not KeyboardInterrupt/SystemExit)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def root_cause(e: BaseException) -> str:
    """`Type: first line` of the error behind `e` (the first failing rank's, for a CheckpointException)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    text = str(e).strip()
    first = text.splitlines()[0].strip().split(". ")[0] if text else ""
    first = first if len(first) <= 200 else first[:200] + "..."
    if isinstance(e, EOFError) or "truncated" in first or "failed reading zip" in first:
        first = "truncated or corrupt file" + (f": {first}" if first else "")
    return f"{type(e).__name__}: {first}"


def older_checkpoints(path: Path) -> List[str]:
    """Names of the complete step_* directories next to `path` that are older than it, newest first."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted((p.name for p in path.parent.iterdir()
                   if p.is_dir() and p.name.startswith("step_") and p.name < path.name
                   and (p / "metadata.json").is_file()), reverse=True)


def unusable_checkpoint_message(path: Path, e: BaseException, resume: bool = True) -> str:
    """One line: which checkpoint, why (damaged or another model) and how to go on."""
    path = Path(path)
    cause = root_cause(e)
    if any(m in cause.lower() for m in _MISMATCH):
        fix = ("resume with the model settings it was saved with "
               f"({path.parent / 'model_config.json'}), or start fresh with checkpoint.resume=never checkpoint.overwrite=true"
               if resume else "model.load needs a checkpoint of this architecture")
        return f"checkpoint {path} does not fit this model ({cause}): {fix}"
    return damaged_message(path, cause, resume)


def damaged_message(path: Path, cause: str, resume: bool = True) -> str:
    path = Path(path)
    older = older_checkpoints(path)
    if resume:
        if older:
            fix = (f"resume from an older one by writing its name ({older[0]}) into {path.parent / 'latest'}, "
                   "or start fresh with checkpoint.resume=never checkpoint.overwrite=true")
        else:
            fix = "no older checkpoint is next to it: start fresh with checkpoint.resume=never checkpoint.overwrite=true"
    else:
        fix = f"point model.load at an older one ({path.parent / older[0]})" if older else "convert or copy it again"
    return f"checkpoint {path} is damaged ({cause}): {fix}"


def check_metadata(path: Path, resume: bool = True) -> None:
    """A checkpoint directory's `metadata.json` must be a JSON object and its `.metadata` (torch_dist)
    readable; checked before loading, which would otherwise log a traceback on every rank."""
    path = Path(path)
    try:
        if not isinstance(json.loads((path / "metadata.json").read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(damaged_message(path, f"metadata.json: {root_cause(e)}", resume)) from None
    if (path / "metadata.json").read_text().find("torch_dist") < 0:
        return  # another backend: nothing more to check here
    # megatron-core 0.16's loader fails on a missing one with "'str' object has no attribute 'iterdir'"
    if megatron_version.common_state_file() and not (path / "common.pt").is_file():
        raise CheckpointError(damaged_message(path, "common.pt: missing", resume))
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing, truncated or garbage: all damage
        raise CheckpointError(damaged_message(path, f".metadata: {root_cause(e)}", resume)) from None


def load_rng_collectively(file: Path, ckpt_dir: Path) -> Optional[dict]:
    """torch.load(file) on this rank (None if absent); if any rank's file is damaged, all ranks raise."""
    rng, error = None, ""
    if file.exists():
        try:
            rng = torch.load(file, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is damage, reported below
            error = f"{file.relative_to(ckpt_dir)}: {root_cause(e)}"
    first = first_problem(error)
    if first:
        raise CheckpointError(damaged_message(Path(ckpt_dir), first))
    return rng
