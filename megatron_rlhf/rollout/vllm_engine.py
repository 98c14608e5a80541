"""The vLLM engine's entry checks (GPU only; vllm is imported lazily, never at module import).

`require_vllm()` is called at start when `rollout.engine=vllm`, so a run that cannot use vLLM fails
with one line before any work.
"""

from __future__ import annotations

import importlib.util

import torch


def require_vllm() -> None:
    """One-line ConfigError when vLLM cannot run here: no CUDA device, or the vllm package missing."""
    from megatron_rlhf.fields import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("rollout.engine=vllm needs CUDA GPUs and none is visible: use rollout.engine=megatron on CPU")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs the vllm package, which is not installed: "
                          "pip install vllm, or use rollout.engine=megatron")
