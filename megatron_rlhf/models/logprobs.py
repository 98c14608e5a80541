"""Per-token log-probabilities and entropy from vocab-parallel logits.

With tensor parallelism, Megatron's output layer leaves each TP rank with a contiguous slice of the
vocabulary: logits [b, s, V_padded / tp], rank r holding ids [r * V/tp, (r+1) * V/tp). The softmax
needs the whole row, so each function all-reduces three small [b, s] tensors over the TP group
(the max, the sum of exponentials, and the picked logit / the sum p*z) instead of gathering the
logits. Results are identical at every TP size, and the backward pass is computed locally from
the saved softmax (no collective), which is what Megatron's vocab-parallel cross entropy does.

Vocab padding: Megatron pads the vocabulary so every shard is equally wide; pass the true
`vocab_size` and the padded ids get probability 0 (otherwise their random logits steal mass).
Statistics are computed in at least fp32 whatever the logits dtype (bf16 -> fp32, fp64 stays fp64).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.utils import VocabUtility


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group=None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax(logits / temperature)[label] per token: logits [b, s, V/tp], labels [b, s] -> [b, s] (>= fp32).

    tp_group: the tensor-parallel group the vocab is split over (None: logits hold the whole vocab).
    Differentiable with respect to `logits`.
    """
    _check(logits, tp_group, vocab_size, labels)
    return _VocabParallelLogprob.apply(logits, labels, tp_group, vocab_size, temperature)


def token_entropy(
    logits: torch.Tensor, tp_group=None, vocab_size: Optional[int] = None, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per token: logits [b, s, V/tp] -> [b, s] (>= fp32). Differentiable."""
    _check(logits, tp_group, vocab_size)
    return _VocabParallelEntropy.apply(logits, tp_group, vocab_size, temperature)


def _check(logits: torch.Tensor, tp_group, vocab_size: Optional[int], labels: Optional[torch.Tensor] = None) -> None:
    tp = _world(tp_group)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [b, s, vocab/tp], got {tuple(logits.shape)}")
    if labels is not None and labels.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} must be [b, s] = {tuple(logits.shape[:2])} of the logits")
    if vocab_size is not None and vocab_size > logits.shape[-1] * tp:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds {tp} shard(s) x {logits.shape[-1]} logits: "
            "pass tp_group= the tensor-parallel group the logits are split over"
        )


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _shard_range(logits: torch.Tensor, group) -> Tuple[int, int]:
    rank = 0 if group is None else dist.get_rank(group)
    return VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, _world(group))


def _softmax_stats(logits: torch.Tensor, group, vocab_size: Optional[int], temperature: float):
    """(shifted logits z - max, local softmax p, log of the global sum of exp, padding mask or None).

    z is >= fp32, shifted by the global max for stability; padded ids are -inf in z and 0 in p.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    start, end = _shard_range(logits, group)
    padded = None
    if vocab_size is not None and end > vocab_size:
        padded = torch.arange(start, end, device=z.device) >= vocab_size
        z = z.masked_fill(padded, float("-inf"))
    z_max = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
    z = z - z_max.unsqueeze(-1)
    exp = torch.exp(z)
    sum_exp = _all_reduce(exp.sum(dim=-1), group)
    return z, exp / sum_exp.unsqueeze(-1), torch.log(sum_exp), padded


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, temperature):
        z, probs, log_sum_exp, _ = _softmax_stats(logits, group, vocab_size, temperature)
        start, end = _shard_range(logits, group)
        local = (labels >= start) & (labels < end)
        local_ids = torch.where(local, labels - start, torch.zeros_like(labels))
        picked = torch.gather(z, -1, local_ids.unsqueeze(-1)).squeeze(-1)
        # Only the rank owning the label contributes its logit to the sum.
        picked = _all_reduce(torch.where(local, picked, torch.zeros_like(picked)), group)
        ctx.save_for_backward(probs, local, local_ids)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return picked - log_sum_exp

    @staticmethod
    def backward(ctx, grad_out):
        probs, local, local_ids = ctx.saved_tensors
        # d logp[label] / d z_j = 1[j == label] - p_j, for this rank's slice of j.
        grad = -probs
        grad.scatter_add_(-1, local_ids.unsqueeze(-1), local.to(grad.dtype).unsqueeze(-1))
        grad = grad * (grad_out.unsqueeze(-1) / ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group, vocab_size, temperature):
        z, probs, log_sum_exp, padded = _softmax_stats(logits, group, vocab_size, temperature)
        if padded is not None:
            z = z.masked_fill(padded, 0.0)  # p = 0 there; avoid 0 * -inf = NaN
        # H = -sum_j p_j log p_j = log sum exp(z) - sum_j p_j z_j
        expected_z = _all_reduce((probs * z).sum(dim=-1), group)
        entropy = log_sum_exp - expected_z
        ctx.save_for_backward(probs, z, log_sum_exp, entropy)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return entropy

    @staticmethod
    def backward(ctx, grad_out):
        probs, z, log_sum_exp, entropy = ctx.saved_tensors
        # dH / dz_j = -p_j (log p_j + H), log p_j = z_j - log_sum_exp; 0 on padded ids (p_j = 0).
        log_p = z - log_sum_exp.unsqueeze(-1)
        grad = -probs * (log_p + entropy.unsqueeze(-1))
        grad = grad * (grad_out.unsqueeze(-1) / ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None
