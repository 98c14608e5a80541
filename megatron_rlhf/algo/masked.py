"""Masked reductions over [B, T] token tensors, optionally global over a process group.

With `group` (e.g. the data-parallel group) sums and counts are all-reduced, so every rank gets the
statistics of the whole batch: whitening on N ranks equals whitening of the concatenated batch.
Ranks may hold different shapes; only scalars travel. Gradients, where they flow, are those of the
global statistic with respect to this rank's elements.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x * mask, but exactly 0 on padding even where x holds inf/NaN (0 * inf would be NaN).

    Applied to inputs before any arithmetic, it also keeps NaN out of gradients.
    """
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of `x` where `mask` is 1. x, mask: same shape. dim=None -> scalar; else reduce that dim."""
    _check_same_shape(x, mask)
    masked = zero_padding(x, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, group=None, dim: Optional[int] = None
) -> torch.Tensor:
    """Mean of `x` over masked-in elements; global over `group` when given.

    dim=None -> scalar over all elements (the only form that takes a group); dim=d -> per-row means
    along d, local. An empty mask gives 0 rather than NaN (the count is clamped to 1).
    """
    _check_same_shape(x, mask)
    if dim is not None:
        if group is not None:
            raise ValueError("masked_mean: a per-dim mean is local; pass dim=None to use a process group")
        return zero_padding(x, mask).sum(dim) / mask.sum(dim).clamp(min=1)
    total, count = _global_sum_and_count(x, mask, group)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, group=None, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over masked-in elements (scalar), global over `group` when given.

    Two passes (mean first, then squared deviations) for numerical stability. `unbiased` applies
    Bessel's correction n/(n-1) with the global n.
    """
    return _mean_and_var(x, mask, group, unbiased)[1]


def whiten(
    x: torch.Tensor, mask: torch.Tensor, group=None, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with masked (global over `group`) statistics; 0 on padding.

    shift_mean=False keeps the original mean (only rescales), as some implementations do for rewards.
    """
    mean, var = _mean_and_var(x, mask, group, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_padding(out, mask)


def _mean_and_var(x: torch.Tensor, mask: torch.Tensor, group, unbiased: bool):
    """(mean, variance) in two passes: two all-reduces with a group."""
    mean = masked_mean(x, mask, group)
    sq_sum, count = _global_sum_and_count((x - mean) ** 2, mask, group)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    return mean, sq_sum / denom


def _global_sum_and_count(x: torch.Tensor, mask: torch.Tensor, group):
    """(masked sum of x, number of masked-in elements), all-reduced over `group` in one collective."""
    _check_same_shape(x, mask)
    # At least fp32: bf16 cannot count past 256 tokens exactly.
    dtype = torch.promote_types(x.dtype, torch.float32)
    local = torch.stack([zero_padding(x, mask).sum().to(dtype), mask.sum().to(dtype)])
    total = _all_reduce_sum(local, group)
    return total[0], total[1].detach()


def _check_same_shape(x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match values {tuple(x.shape)}: pass the [B, T] response mask"
        )


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` over `group`; the result carries gradient to the local `t` only (d global / d local = 1)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    total = t.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    # Local value + the other ranks' contribution as a constant.
    return t + (total - t.detach())
