"""The start of a training stage: checks before any slow work, and what to say after resuming.

A run directory that cannot be written would otherwise fail at the first checkpoint or metrics
write, after the data has been tokenised and the model built (data loading, model building and
process groups come later).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from megatron_rlhf.config.schema import ConfigError


def check_writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and write (then remove) a probe file in it; ConfigError naming `key` if not.

    An actual write is the only reliable test: os.access says yes to root on a read-only mount.
    """
    parent = path
    while parent and not os.path.exists(parent):  # the nearest existing ancestor
        parent = os.path.dirname(parent.rstrip(os.sep)) or ("." if not os.path.isabs(path) else os.sep)
    if parent and not os.path.isdir(parent):
        where = "is a file" if parent == path else f"is inside '{parent}', which is a file"
        raise ConfigError(f"{key}='{path}' {where}, not a directory: choose another {key}")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ConfigError(f"{key}='{path}' is not writable ({why}): choose another {key} "
                          "or fix its permissions") from None


def check_run_dirs(cfg) -> None:
    """The run directory and the checkpoint directory (when set apart) can be written."""
    check_writable_dir(cfg.logging.run_dir, "logging.run_dir")
    if cfg.checkpoint.dir:
        check_writable_dir(cfg.checkpoint.dir, "checkpoint.dir")


def resume_message(path, step: int, total_steps: int, exit_at_step: Optional[int]) -> str:
    """What rank 0 says after resuming; says so when there is nothing left to train."""
    msg = f"resumed from {path} at step {step}"
    if step >= total_steps:
        return (f"{msg}: the run is already finished ({total_steps} steps), nothing to train; raise "
                "train.train_steps (or train.epochs) to train on, or use another logging.run_dir")
    if exit_at_step is not None and step >= exit_at_step:
        return f"{msg}: train.exit_at_step={exit_at_step} is already reached, nothing to train; raise or unset it"
    return msg
