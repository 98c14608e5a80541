"""The small layer that lets the pinned megatron-core run on CPU (tests and tiny runs).

Megatron-Core 0.16.1 has no CPU path: it names CUDA in many places. This module is the only
place in the project that knows the difference between CPU and GPU. `enable()` is a no-op when
CUDA is available; otherwise it neutralises exactly these CUDA assumptions (each was hit on CPU):

1. Hard-coded ``device="cuda"``, ``torch.cuda.current_device()`` and ``.cuda()`` (RoPE ``inv_freq``,
   attention's global memory buffer, causal masks, pipeline token counters, the optimizer's loss
   scale): a global ``TorchFunctionMode`` rewrites CUDA device arguments to CPU, ``Tensor.cuda``
   becomes a no-op, and ``torch.cuda.current_device()`` returns ``"cpu"``. The same mode makes
   ``Tensor.type()`` report ``torch.cuda.*Tensor`` names, because the (distributed) optimizers
   reject parameters whose type string is not a CUDA one.
2. The RNG tracker: ``torch.cuda.{get,set}_rng_state/manual_seed`` and Megatron's
   ``_get_cuda_rng_state/_set_cuda_rng_state`` use the CPU generator, so
   ``model_parallel_cuda_manual_seed`` (still required before building a model) and
   ``get_cuda_rng_tracker().fork()`` work.
3. ``torch.cuda.synchronize`` (and stream helpers used by the resharding copy service) are no-ops.
4. ``clip_grad_by_total_norm_fp32`` asserts CUDA gradients: replaced by a CPU version that scales
   the gradients in place by the same rule, so gradient clipping still works.
5. Model settings (`transformer_config_overrides`): CPU initialisation, no fused CUDA kernels, and
   unbatched pipeline send/recv (batched isend/irecv on gloo races in the interleaved schedule:
   later microbatches read wrong activations).
6. ``dist_checkpointing`` needs ``psutil`` (checked here, because a missing one hangs the other rank)
   and starts a ``spawn`` manager: entry points must be import-safe (``if __name__ == "__main__"``).

The layer is checked against the installed megatron-core version and refuses any other one,
because each patch targets a specific release's internals.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON_CORE = "0.16.1"

_enabled = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every ``device=`` naming CUDA to CPU, and makes ``Tensor.cuda`` return ``self``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers dispatch on 'torch.cuda.FloatTensor'-style names.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func in (torch.Tensor.to,) and args[1:] and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: work on CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return None


def transformer_config_overrides() -> dict:
    """TransformerConfig settings that differ on CPU (see item 5 of the module docstring); {} on GPU."""
    if cuda_available():
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,
    )


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of megatron's clip: grads *= max_norm / (total_norm + 1e-6) when that is < 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _check_versions() -> None:
    installed = importlib.metadata.version("megatron-core")
    if installed != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron_rlhf's CPU layer supports megatron-core=={SUPPORTED_MEGATRON_CORE}, "
            f"found {installed}: install megatron-core=={SUPPORTED_MEGATRON_CORE} to run on CPU"
        )
    try:
        import psutil  # noqa: F401
    except ImportError as e:  # pragma: no cover - install-time problem
        raise RuntimeError("psutil is required by megatron's dist_checkpointing: pip install psutil") from e


def enable() -> bool:
    """Install the CPU layer once per process. Returns True if it is active (no CUDA)."""
    global _enabled
    if cuda_available():
        return False
    if _enabled:
        return True
    _check_versions()

    # 1. devices
    _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0

    # 2. RNG: the "CUDA" generator is the CPU generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 3. synchronisation and streams
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # 4. gradient clipping
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu

    # 5. GPU-only advice that is noise here
    import warnings

    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")

    _enabled = True
    return True
