"""Megatron DDP's gradient buffers of half-precision weights zeroed by their first write, on CPU.

Each optimizer step zeroes DDP's flat fp32 gradient buffers (540 MB per 135M-parameter model), and the
backward then adds every bf16 weight gradient into them through DDP's hook, converting it (reads 2 + 4
bytes and writes 4 per element). With one micro-batch per step every element is written once, so the
zeroing and the read are wasted passes. Here `zero_grads` marks each parameter's `main_grad` unwritten
instead of zeroing, and the first write of a step overwrites: the hook copies (converting; 33 ms against a
30-ms zeroing and a 72-ms add per 135M parameters), and the embedding lookup (parallel/cpu.py item 8), whose
rows cover only the tokens seen, zeroes first. `settle` zeroes what no write reached; it runs before anything
reads the buffers: at the start of `finalize_grads` (before the data-parallel reduction and DDP's NaN check)
and of the optimizer step; code that reads `main_grad` after `zero_grads` by any other path must `settle`
first. About 4% of a bf16 PPO iteration at the SmolLM2-135M shape (`benchmarks/grad_buffer.py`,
docs/performance.md run Q).

Buffers whose weights are fp32 are zeroed as Megatron zeroes them: their weight gradients accumulate inside
the GEMM (item 8, beta 1), and an overwriting GEMM (beta 0) measured 1-8% slower per call on a cold buffer,
about what the zeroing costs, and no faster in the PPO iteration.

Only while the CPU layer is on (`parallel/cpu.py` item 12 installs the hook); on GPU `zero_grads` is
Megatron's `zero_grad_buffer`, whose memset costs little there.
"""

from __future__ import annotations

from typing import List

import torch

_hook_installed = False  # set by `install_hook`, which only the CPU layer calls


def first_write(main_grad: torch.Tensor) -> bool:
    """True once per step for a `main_grad` that `zero_grads` marked unwritten (the mark is cleared): the
    caller overwrites it instead of adding into it."""
    if getattr(main_grad, "unwritten", False):
        main_grad.unwritten = False
        return True
    return False


def ddp_buffers(chunk) -> List:
    """A Megatron DDP chunk's gradient buffers, the expert-parallel ones included; [] for a module that is not
    DDP (a plain nn.Module's `buffers` is a method)."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):
        return []
    return [*buffers, *(getattr(chunk, "expert_parallel_buffers", None) or [])]


def _lazy(chunk) -> bool:
    """A Megatron DDP chunk whose backward hooks are `install_hook`'s, which overwrite unwritten gradients (a
    chunk built before the hook was installed adds, so its buffers are zeroed)."""
    return getattr(chunk, "first_write_hooks", False)


def _no_reset():
    return None


def zero_grads(chunks: List[torch.nn.Module]) -> None:
    """Megatron's `zero_grad_buffer` for each chunk, with the buffers of half-precision weights marked unwritten
    instead of zeroed where the CPU layer's hook is in place."""
    for chunk in chunks:
        if not _lazy(chunk):
            chunk.zero_grad_buffer()
            continue
        buffers = [b for b in ddp_buffers(chunk) if b.param_dtype != b.grad_dtype]  # fp32 weights: zeroed as before
        for buffer in buffers:
            for param in buffer.params:
                param.main_grad.unwritten = True
            buffer.reset = _no_reset  # the one step of zero_grad_buffer left out: zeroing grad_data
        try:
            chunk.zero_grad_buffer()  # per-parameter flags and the bucket groups' state, as Megatron resets them
        finally:
            for buffer in buffers:
                del buffer.reset


def settle(chunks: List[torch.nn.Module]) -> None:
    """Zero every gradient that no write of this step reached (a parameter outside the loss), so the buffers
    read as eagerly zeroed ones would. Idempotent; nothing to do after an eager `zero_grads`."""
    for chunk in chunks:
        for buffer in ddp_buffers(chunk):
            for param in buffer.params:
                if first_write(param.main_grad):
                    param.main_grad.zero_()


def install_hook() -> None:
    """Megatron DDP's backward post-hook (megatron-core 0.16.1's `_make_backward_post_hook`) with the add into
    `main_grad` made a copy on the step's first write. For DDP instances built after this call."""
    global _hook_installed
    if _hook_installed:
        return
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.distributed_data_parallel import is_graph_capturing

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        self.first_write_hooks = True  # DDP's __init__ makes every parameter's hook here

        def hook(*unused):
            if is_graph_capturing():
                return
            if param in self.param_to_bucket_group:
                assert param.requires_grad
                if self.ddp_config.overlap_grad_reduce:
                    assert param.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
                if param.grad is not None and (
                        not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
                    if first_write(param.main_grad):
                        param.main_grad.copy_(param.grad.data)
                    else:
                        param.main_grad.add_(param.grad.data)
                param.grad = None
                if self.ddp_config.overlap_grad_reduce:
                    self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)
        return hook

    DistributedDataParallel._make_backward_post_hook = _make_backward_post_hook
    _hook_installed = True
