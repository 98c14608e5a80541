"""What every config group module needs: the error type, a field with help text, and small checks
(and loading a `module:function` scorer, which the PPO, DPO and preference-pair stages share)."""

from __future__ import annotations

import glob
import importlib
import os
from dataclasses import field
from typing import Any, Callable, List, Optional, Sequence


GoldScorer = Callable[[List[str], List[str]], Sequence[float]]


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


def load_gold_scorer(spec: Optional[str], option: str = "ppo.gold_scorer=") -> Optional[GoldScorer]:
    """'module:function' -> the function (None when not configured); `option` names the setting in errors."""
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, a SyntaxError or any error of its module
        raise ConfigError(f"{option}{spec!r} cannot be imported ({type(e).__name__}: {e}): give an "
                          "importable 'module:function'") from None
    if not callable(fn):
        raise ConfigError(f"{option}{spec!r} is a {type(fn).__name__}, not a function: give "
                          "'module:function' of a function (prompts, responses) -> one score per pair")
    return fn
