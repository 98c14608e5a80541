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

Cost: at a 49k vocabulary these [b, s, V] passes are the largest non-GEMM work of a PPO iteration, so
the log-prob kernel works on blocks of rows that fit in cache (no [b, s, V] temporaries; the backward
recomputes the softmax from the saved logits), and `token_logprobs_and_entropy` serves the policy loss's
log-probs and its entropy diagnostic from the same pass.
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
    """(shifted logits z = (logits - max) / temperature, local softmax p, log of the global sum of exp,
    padding mask or None).

    z is >= fp32, shifted by the global max for stability; padded ids are -inf in z and 0 in p.
    Three full-size results are written (z, exp -> p in place); the max is taken over the raw logits
    (max(x / T) = max(x) / T for T > 0).
    """
    start, end = _shard_range(logits, group)
    padded = None
    if vocab_size is not None and end > vocab_size:
        padded = torch.arange(start, end, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, float("-inf"))
    z_max = _all_reduce(logits.max(dim=-1).values.to(torch.promote_types(logits.dtype, torch.float32)),
                        group, dist.ReduceOp.MAX)
    z = logits - z_max.unsqueeze(-1)  # promotes bf16 logits to fp32
    if temperature != 1.0:
        z.mul_(1.0 / temperature)
    probs = torch.exp(z)
    sum_exp = _all_reduce(probs.sum(dim=-1), group)
    probs.div_(sum_exp.unsqueeze(-1))
    return z, probs, torch.log(sum_exp), padded


def _expected_z(probs: torch.Tensor, z: torch.Tensor, group) -> torch.Tensor:
    """sum_j p_j z_j over the whole vocabulary -> [b, s] (z finite: padded ids zeroed); one read of each, no
    temporary (`vecdot`: a batched [1, V] x [V, 1] `bmm` ran ~25x slower on CPU)."""
    dot = torch.linalg.vecdot(probs, z)
    return _all_reduce(dot, group)


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                               vocab_size: Optional[int] = None, temperature: float = 1.0):
    """(log-probs [b, s], entropy [b, s]) from one softmax of logits [b, s, V/tp]; labels [b, s].

    The log-probs are differentiable; the entropy is not (a diagnostic: use `token_entropy` to train it).
    """
    _check(logits, tp_group, vocab_size, labels)
    out = {}
    logp = _VocabParallelLogprob.apply(logits, labels, tp_group, vocab_size, temperature, out)
    return logp, out["entropy"]


CHUNK_BYTES = 1 << 21  # rows per block of the log-prob kernel: about 2 MB of fp32, so a block stays in cache


def _row_blocks(rows: int, width: int):
    step = max(1, CHUNK_BYTES // (4 * max(width, 1)))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _shifted(block: torch.Tensor, row_max: torch.Tensor, temperature: float, padded) -> torch.Tensor:
    """(logits - max) / T in >= fp32 for one block of rows [n, V]; padded ids -inf. A new tensor."""
    z = block - row_max.unsqueeze(-1)  # promotes bf16 logits to fp32
    if temperature != 1.0:
        z.mul_(1.0 / temperature)
    if padded is not None:
        z.masked_fill_(padded, float("-inf"))
    return z


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits / T)[label], computed block by block of rows so the [rows, V] temporaries stay in
    cache: the forward reads the logits twice (max, then exp-sum) and writes nothing of their size; the
    backward recomputes the softmax from the saved logits and writes the gradient once. (Saving the
    softmax instead would write and read it once more.)"""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, temperature, entropy_out=None):
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        stat_dtype = torch.promote_types(logits.dtype, torch.float32)
        start, end = _shard_range(logits, group)
        padded = None
        if vocab_size is not None and end > vocab_size:
            padded = torch.arange(start, end, device=logits.device) >= vocab_size
        row_max = (flat if padded is None else flat.masked_fill(padded, float("-inf"))).amax(-1).to(stat_dtype)
        row_max = _all_reduce(row_max, group, dist.ReduceOp.MAX)
        sum_exp = torch.empty(flat.shape[0], dtype=stat_dtype, device=logits.device)
        sum_ez = torch.empty_like(sum_exp) if entropy_out is not None else None
        for i, j in _row_blocks(flat.shape[0], V):
            z = _shifted(flat[i:j], row_max[i:j], temperature, padded)
            e = torch.exp(z)
            sum_exp[i:j] = e.sum(-1)
            if sum_ez is not None:  # sum_j e_j z_j, the entropy's expectation before normalising
                if padded is not None:
                    z.masked_fill_(padded, 0.0)  # e = 0 there; avoid 0 * -inf = NaN
                sum_ez[i:j] = torch.linalg.vecdot(e, z)  # bmm of [1, V] x [V, 1] was ~25x slower on CPU
        sum_exp = _all_reduce(sum_exp, group)
        log_sum_exp = torch.log(sum_exp)
        local = (labels >= start) & (labels < end)
        local_ids = torch.where(local, labels - start, torch.zeros_like(labels)).reshape(-1)
        picked = flat.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1).to(stat_dtype)
        picked = (picked - row_max) / temperature
        # Only the rank owning the label contributes its logit to the sum.
        picked = _all_reduce(torch.where(local.reshape(-1), picked, torch.zeros_like(picked)), group)
        if entropy_out is not None:  # H = log sum exp(z) - sum_j p_j z_j, from the same pass
            entropy_out["entropy"] = (log_sum_exp - _all_reduce(sum_ez, group) / sum_exp).view(labels.shape)
        ctx.save_for_backward(logits, row_max, log_sum_exp, local, local_ids)
        ctx.temperature, ctx.padded = temperature, padded
        return (picked - log_sum_exp).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, row_max, log_sum_exp, local, local_ids = ctx.saved_tensors
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        # d logp[label] / d logits_j = (1[j == label] - p_j) / T, for this rank's slice of j.
        scale = (grad_out.reshape(-1) / ctx.temperature).to(log_sum_exp.dtype)
        onehot = (local.reshape(-1).to(scale.dtype) * scale).unsqueeze(-1)
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)
        for i, j in _row_blocks(flat.shape[0], V):
            p = _shifted(flat[i:j], row_max[i:j], ctx.temperature, ctx.padded)
            p.sub_(log_sum_exp[i:j].unsqueeze(-1)).exp_()
            p.mul_(-scale[i:j].unsqueeze(-1))
            p.scatter_add_(-1, local_ids[i:j].unsqueeze(-1), onehot[i:j])
            grad[i:j] = p
        return grad.view(logits.shape), None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group, vocab_size, temperature):
        z, probs, log_sum_exp, padded = _softmax_stats(logits, group, vocab_size, temperature)
        if padded is not None:
            z = z.masked_fill(padded, 0.0)  # p = 0 there; avoid 0 * -inf = NaN
        # H = -sum_j p_j log p_j = log sum exp(z) - sum_j p_j z_j
        entropy = log_sum_exp - _expected_z(probs, z, group)
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
