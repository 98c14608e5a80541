"""Megatron `forward_step -> (output, loss_func)` adapters and one optimizer step through the schedule.

A loss function here has the signature `loss_fn(output, batch) -> (loss_sum, num_tokens, stats)`
where `stats` maps names to `(sum, count)` pairs of detached tensors. Sums are reduced over
microbatches and data-parallel ranks, then divided once (see trainer/optim.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple

import torch

from megatron_rlhf.models.logit_rows import logits_at
from megatron_rlhf.parallel import grad_buffer
from megatron_rlhf.parallel.device import on_device_of
from megatron_rlhf.trainer import optim

Batch = Dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], Tuple[torch.Tensor, torch.Tensor, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]]


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s] positions 0..s-1 (right padding keeps real tokens at their true positions)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def make_forward_step(loss_fn: LossFn, model_kwargs: Callable[[Batch], dict] | None = None,
                      rows: Callable[[Batch], torch.Tensor | None] | None = None):
    """Build the `forward_step(data_iterator, model)` that Megatron's pipeline schedules call.

    `model_kwargs(batch)` adds keyword arguments to the model call (e.g. `labels`). `rows(batch)` ([b, T]
    positions or None): an LM's logits come only at those rows, [b, T, V/tp] (models/logit_rows.py).
    """
    def forward_step(data_iterator, model):
        batch = on_device_of(model, next(data_iterator))
        input_ids = batch["input_ids"]
        extra = model_kwargs(batch) if model_kwargs else {}
        with logits_at(model, rows(batch) if rows else None):
            output = model(input_ids, batch.get("position_ids", position_ids_for(input_ids)), None, **extra)

        def loss_func(output_tensor):
            loss_sum, num_tokens, stats = loss_fn(output_tensor, batch)
            # Copies: the schedule may rescale the loss tensor in place. Reduced in `reduce_stats`.
            stats = {k: (s.detach().clone(), c.detach().clone()) for k, (s, c) in stats.items()}
            return loss_sum, num_tokens.to(torch.int), stats

        return output, loss_func

    return forward_step


def reduce_stats(per_microbatch: List[dict], names: List[str] | None = None) -> Dict[str, float]:
    """Sum `(sum, count)` stats over microbatches and DP ranks; every rank gets the means.

    Only the last pipeline stage has loss outputs; the result is broadcast along the pipeline.
    Pass `names` when some data-parallel rank may have no microbatches (evaluation tails).
    """
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_last_rank()
    if names is None:
        # Every rank needs the same names: agree on them over the pipeline group first.
        names_box = [sorted(per_microbatch[0]) if per_microbatch else []]
        torch.distributed.broadcast_object_list(names_box, src=last, group=pp_group)
        names = names_box[0]
    if not names:
        return {}
    buf = torch.zeros(len(names), 2, dtype=torch.float64)
    # A stat may be on the GPU, another on the host: sum each device's stats there and copy each total once
    # (one wait for the GPU per step, not two per stat and micro-batch).
    totals: Dict[torch.device, torch.Tensor] = {}
    for mb in per_microbatch:
        for i, n in enumerate(names):
            s, c = mb[n]
            if s.device not in totals:
                totals[s.device] = torch.zeros(len(names), 2, dtype=torch.float64, device=s.device)
            totals[s.device][i, 0] += s.detach().double().sum()
            totals[s.device][i, 1] += c.detach().double().sum().to(s.device)
    for total in totals.values():
        buf += total.cpu()
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(buf, group=ps.get_data_parallel_group(with_context_parallel=True))
    torch.distributed.broadcast(buf, src=last, group=pp_group)
    return {n: (buf[i, 0] / buf[i, 1].clamp(min=1)).item() for i, n in enumerate(names)}


def run_schedule(
    chunks: List[torch.nn.Module],
    microbatches: List[Batch],
    forward_step,
    *,
    forward_only: bool = False,
) -> List[dict]:
    """Run Megatron's schedule (no pipelining, 1F1B or interleaved) over `microbatches`.

    Every rank of a model-parallel group passes the same microbatches; each model chunk reads them
    through its own iterator, as the interleaved schedule expects.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mb0 = microbatches[0]["input_ids"]
    seq_len = max(mb["input_ids"].shape[1] for mb in microbatches)
    if any(mb["input_ids"].shape[1] != seq_len for mb in microbatches) and pipeline_stages() > 1:
        raise ValueError("pipeline parallelism needs every microbatch padded to the same sequence length")
    iterators = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=mb0.shape[0],
        forward_only=forward_only,
    )


def pipeline_stages() -> int:
    """The pipeline-parallel size of Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def train_step(chunks, optimizer, scheduler, microbatches: Iterable[Batch], forward_step,
               skip_nonfinite: bool = False) -> Dict[str, float]:
    """Zero grads, forward/backward over all microbatches, optimizer step, scheduler step.

    Returns reduced stats plus `grad_norm`, `lr` and `skipped` (1.0 if the step was skipped).
    `skip_nonfinite`: a NaN/Inf gradient on any rank skips the optimizer step (weights, optimizer
    state and schedule untouched) instead of applying it; the caller decides when to give up.
    """
    microbatches = list(microbatches)
    grad_buffer.zero_grads(chunks)
    optimizer.zero_grad()
    outputs = run_schedule(chunks, microbatches, forward_step)
    ok, grad_norm = optim.optimizer_step(optimizer, chunks, skip_nonfinite)
    if ok:
        scheduler.step(increment=1)
    stats = reduce_stats(outputs)
    stats["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
    stats["lr"] = optimizer.param_groups[0]["lr"]
    stats["skipped"] = 0.0 if ok else 1.0
    return stats
