"""What every config group module needs: the error type, a field with help text, and small checks."""

from __future__ import annotations

import glob
import os
from dataclasses import field
from typing import Any, Optional, Sequence


class ConfigError(ValueError):
    """A bad configuration. The message is one line naming the key, the value and the fix."""


def help_field(default: Any = None, help: str = "", choices: Optional[Sequence[Any]] = None, factory=None):
    """A dataclass field with a help text (shown by `--help`) and optional allowed values."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def require(cond: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `cond`."""
    if not cond:
        raise ConfigError(message)


def paths_exist(pattern: str) -> bool:
    """A path, or a glob pattern that matches at least one path."""
    return os.path.exists(pattern) or bool(glob.glob(pattern))
