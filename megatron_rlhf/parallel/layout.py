"""Parallel layouts as data: a `ParallelConfig` value validated before any work is done.

Model code never reads global state to learn its layout; it is handed a validated `ParallelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class LayoutError(ValueError):
    """An impossible parallel layout. The message is one line naming the numbers and the fix."""


RECOMPUTE_CHOICES = (None, "selective", "full")


# Gradients accumulate and are reduced in an fp32 buffer whatever the parameter dtype (4 bytes per
# parameter): the DDP setting of trainer/optim.py, which the memory planner (plan/memory.py) counts.
GRAD_REDUCE_IN_FP32 = True


@dataclass
class ParallelConfig:
    """How one model is split over the world.

    dp is derived: world_size / (tp * pp * cp).
    """

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: Optional[int] = None  # virtual pipeline stages (model chunks) per pipeline rank
    cp: int = 1  # context parallel
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute: Optional[str] = None  # activation recompute: None | "selective" (attention) | "full" (every layer)
    # Seconds a rank may wait in a collective for the others before the job is ended, naming the rank it
    # waited for (parallel/watchdog.py); the process-group timeout is set a minute beyond it.
    timeout_s: int = 600

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


@dataclass
class Fp8Config:
    """FP8 through Transformer Engine (GPU only). `format=None` means off."""

    format: Optional[str] = None  # "e4m3" | "hybrid"
    recipe: str = "delayed"  # "delayed" | "tensorwise" | "mxfp8" | "blockwise"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0


def validate_layout(
    parallel: ParallelConfig,
    world_size: int,
    *,
    num_layers: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    fp8: Optional[Fp8Config] = None,
    cuda_available: Optional[bool] = None,
    te_available: Optional[bool] = None,
) -> None:
    """Raise `LayoutError` (one line, naming the numbers) for any layout that cannot work.

    Called before the process group and any model are built, so nothing is lost.
    """
    p = parallel
    for name in ("tp", "pp", "cp"):
        if getattr(p, name) < 1:
            raise LayoutError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if not p.timeout_s >= 10:
        raise LayoutError(f"parallel.timeout_s={p.timeout_s} must be >= 10 (seconds a rank may wait for the others)")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel != 0:
        raise LayoutError(
            f"world size {world_size} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = "
            f"{model_parallel}: change parallel.tp/pp/cp or the number of ranks"
        )
    heads = [n for n in (num_attention_heads, num_query_groups) if n is not None]
    usable = ", ".join(str(d) for d in range(1, min(heads, default=1) + 1) if all(n % d == 0 for n in heads))
    if num_attention_heads is not None and num_attention_heads % p.tp != 0:
        raise LayoutError(
            f"model.num_attention_heads={num_attention_heads} is not divisible by parallel.tp={p.tp}: "
            f"use a tp of {usable} (it must divide the attention heads and the key/value heads)"
        )
    if num_query_groups is not None and num_query_groups % p.tp != 0:
        raise LayoutError(
            f"model.num_query_groups (key/value heads)={num_query_groups} is not divisible by "
            f"parallel.tp={p.tp}: use a tp of {usable} (it must divide the attention heads and the key/value heads)"
        )
    if p.vpp is not None:
        if p.vpp < 1:
            raise LayoutError(f"parallel.vpp={p.vpp} must be >= 1 or unset")
        if p.pp < 2:
            raise LayoutError(f"parallel.vpp={p.vpp} needs parallel.pp > 1 (got pp={p.pp})")
    chunks = p.pp * (p.vpp or 1)
    if num_layers is not None and num_layers % chunks != 0:
        what = f"pp={p.pp}" if p.vpp is None else f"pp*vpp = {p.pp}*{p.vpp} = {chunks}"
        raise LayoutError(
            f"model.num_layers={num_layers} is not divisible by {what}: pick a pipeline size that "
            f"divides {num_layers}"
        )
    if p.recompute not in RECOMPUTE_CHOICES:
        raise LayoutError(f"parallel.recompute={p.recompute!r} is not one of: null, selective, full")
    if p.sequence_parallel and p.tp < 2:
        raise LayoutError(
            f"parallel.sequence_parallel=true needs parallel.tp > 1 (got tp={p.tp}): "
            "set sequence_parallel=false or raise tp"
        )
    if fp8 is not None and fp8.format is not None:
        if fp8.format not in ("e4m3", "hybrid"):
            raise LayoutError(f"fp8.format={fp8.format!r} is not one of 'e4m3', 'hybrid'")
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise LayoutError(
                f"fp8.format={fp8.format!r} needs CUDA, and none is available: set fp8.format=null"
            )
        if te_available is None:
            from megatron_rlhf.parallel.cpu import transformer_engine_available

            te_available = transformer_engine_available()
        if not te_available:
            raise LayoutError(
                f"fp8.format={fp8.format!r} needs Transformer Engine, which is not installed: "
                "pip install 'megatron_rlhf[gpu]' or set fp8.format=null"
            )
