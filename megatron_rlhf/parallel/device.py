"""Where tensors go: this rank's compute device, and the device a model lives on.

Batches, prompts and statistics are built on the host; models sit on the GPU that
`parallel/init.py` selects for the rank (`torch.cuda.set_device(local_rank)`), or on the host without CUDA.
"""

from __future__ import annotations

from typing import Dict

import torch


def compute_device() -> torch.device:
    """This rank's GPU (the current CUDA device), or the host where CUDA is absent."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of `module`'s (first) parameter: where its inputs must be."""
    return next(module.parameters()).device


def on_device_of(module: torch.nn.Module, batch: Dict[str, object]) -> Dict[str, object]:
    """`batch` with its tensors on `module`'s device (a no-op on CPU); other values as they are."""
    device = device_of(module)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
