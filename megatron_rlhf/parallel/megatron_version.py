"""The megatron-core releases this package runs on, and every difference between them that it meets.

Supported and tested: 0.16.1 (Python 3.10-3.11; the CPU machines' default) and 0.19.x (Python >= 3.12, what current
NGC containers ship). Each function here hides one change between them; callers never test the version
themselves. The CPU layer (parallel/cpu.py) keeps its own lists of megatron functions that name CUDA, per release.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Tuple

SUPPORTED = ("0.16.1", "0.19")  # an exact release, or a release series (every 0.19.x)


def installed() -> str:
    return importlib.metadata.version("megatron-core")


@functools.lru_cache(maxsize=None)
def release() -> Tuple[int, int]:
    """(major, minor) of the installed megatron-core, e.g. (0, 19)."""
    major, minor = installed().split(".")[:2]
    return int(major), int(minor)


def is_supported(version: str) -> bool:
    return any(version == s or version.startswith(s + ".") for s in SUPPORTED)


def check_supported() -> None:
    """RuntimeError in one line when the installed megatron-core is not one this package was tested with."""
    version = installed()
    if not is_supported(version):
        raise RuntimeError(
            f"megatron_rlhf supports megatron-core 0.16.1 (Python <= 3.11) and 0.19.x (Python >= 3.12), found "
            f"{version}: install megatron-core==0.16.1 or a 0.19 release (docs/architecture.md, versions)")


def set_mlp_activation(layer_spec: Any, module: type) -> None:
    """Make `module` the whole-GLU activation of a layer spec's MLP (used with use_te_activation_func).
    0.16: the MLP is a ModuleSpec with `.submodules`; 0.19: a `functools.partial(MLP..., submodules=...)`."""
    mlp = layer_spec.submodules.mlp
    submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    submodules.activation_func = module


def common_state_file() -> bool:
    """Whether distributed checkpoints keep their non-sharded ("common") state in a `common.pt` file beside the
    shards. 0.16 writes and needs it; 0.19 writes the common state into the shards (a "common_state" object)
    and still reads a legacy common.pt (as the HF converter writes)."""
    return release() < (0, 19)
