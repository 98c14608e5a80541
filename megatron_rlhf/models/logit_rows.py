"""The LM output layer over chosen positions only, and without Megatron's [S, b, V] -> [b, S, V] copy.

PPO's losses and log-probs read the logits at the response positions alone: [b, T, V] of [b, S, V]. At a
49k vocabulary the output layer is a fifth of the model's FLOPs, and the logits are the largest tensors of
a step. A forward inside `logits_at(model, rows)` projects only the hidden states at `rows`; without it,
every position. Either way the projection runs on batch-major hidden states ([b, *, H], a copy of the
small hidden width), so its [b, *, V] result is already in the layout `GPTModel` returns, and GPTModel's
`transpose(0, 1).contiguous()` is free. That removes, per policy micro-batch: the GEMMs over prompt
positions (forward and both backward), the [S, b, V] -> [b, S, V] copy, the row pick over [b, S, V] (whose
backward wrote a zero [b * S, V] gradient) and the backward's copy of the transposed logits' gradient.

Results are the full forward's rows up to GEMM rounding (each logit is the same dot product; the GEMM kernel may
block a different row count differently): tests/unit/test_logit_rows.py holds them within 1e-6, and PPO's first
ratio stays exactly 1 because the old log-probs and the training forward both run at the response rows.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


def pick_rows(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """output [b, S, X], index [b, T] -> [b, T, X]: row index[i, t] of sequence i.

    Whole rows are picked (index_select on [b * S, X]), not elements: `gather` with an index expanded over a
    49k vocabulary reads an int64 index per logit."""
    b, S, X = output.shape
    rows = (index + S * torch.arange(b, device=index.device).unsqueeze(1)).reshape(-1)
    return output.reshape(b * S, X).index_select(0, rows).view(b, index.shape[1], X)


_SUBCLASSES = {}  # (class, method name) -> the subclass overriding it


def _override(obj: torch.nn.Module, name: str, method) -> None:
    """Switch `obj` to a subclass of its class whose `name` is `method` (a class, not a patched instance
    attribute, so copies of the module keep their own weights); the subclass is marked `batch_major`."""
    cls = type(obj)
    if getattr(cls, "batch_major", False):
        return
    if (cls, name) not in _SUBCLASSES:
        _SUBCLASSES[cls, name] = type(cls.__name__, (cls,), {name: method, "batch_major": True})
    obj.__class__ = _SUBCLASSES[cls, name]


def install(gpt: torch.nn.Module) -> None:
    """Give this GPTModel's LM output layer (a ColumnParallelLinear) the batch-major forward. Megatron's
    own loss path (`labels=`), whose cross entropy views the logits as contiguous [S, b, V], gets them so."""
    _override(gpt.output_layer, "forward", _batch_major_forward)
    _override(gpt, "compute_language_model_loss", _loss_on_contiguous_logits)
    gpt.output_layer.logit_rows = None


def _loss_on_contiguous_logits(self, labels, logits):
    return super(type(self), self).compute_language_model_loss(labels, logits.contiguous())


def _batch_major_forward(self, hidden_states, weight=None, runtime_gather_output=None):
    """hidden [S, b, H] -> (logits [S', b, V/tp] stored batch-major, bias); S' = T inside `logits_at`."""
    inner = super(type(self), self).forward
    rows: Optional[torch.Tensor] = self.logit_rows
    if getattr(self, "sequence_parallel", False):  # the layer gathers [S/tp, b, H] along S itself: pick after
        logits, bias = inner(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        if rows is None:
            return logits, bias
        return pick_rows(logits.transpose(0, 1), rows).transpose(0, 1), bias
    x = hidden_states.transpose(0, 1)  # [b, S, H]
    x = x.contiguous() if rows is None else pick_rows(x, rows)
    # The projection is position-wise: [b, S', H] goes through as if it were [s, b, h].
    logits, bias = inner(x, weight=weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1), bias  # [S', b, V] as Megatron expects; contiguous as [b, S', V]


def _output_layer(model: torch.nn.Module):
    from megatron.core.utils import unwrap_model  # DDP / Float16Module wrappers

    model = unwrap_model(model)
    if not getattr(model, "post_process", False):
        return None
    layer = getattr(model, "output_layer", None)
    return layer if getattr(type(layer), "batch_major", False) else None


def rows_apply(model: torch.nn.Module) -> bool:
    """Whether `logits_at` changes this chunk's forward (its last stage's LM output layer is wrapped)."""
    return _output_layer(model) is not None


@contextlib.contextmanager
def logits_at(model: torch.nn.Module, rows: Optional[torch.Tensor]):
    """Inside: the LM forward of `model` (a chunk, wrapped or not) returns logits [b, T, V/tp] at `rows`
    [b, T] (positions per sequence) instead of [b, S, V/tp]. No-op for rows None, a chunk without the LM
    head (earlier pipeline stages, scalar heads), or a layer `install` did not wrap."""
    layer = _output_layer(model) if rows is not None else None
    if layer is None:
        yield
        return
    layer.logit_rows = rows
    try:
        yield
    finally:
        layer.logit_rows = None
