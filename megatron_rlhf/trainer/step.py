"""Megatron `forward_step -> (output, loss_func)` adapters and one optimizer step through the schedule.

A loss function here has the signature `loss_fn(output, batch) -> (loss_sum, num_tokens, stats)`
where `stats` maps names to `(sum, count)` pairs of detached tensors. Sums are reduced over
microbatches and data-parallel ranks, then divided once (see trainer/optim.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple

import torch

from megatron_rlhf.models import packing
from megatron_rlhf.models.logit_rows import logits_at, rows_apply
from megatron_rlhf.parallel import grad_buffer
from megatron_rlhf.parallel.device import on_device_of
from megatron_rlhf.trainer import optim

Batch = Dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], Tuple[torch.Tensor, torch.Tensor, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]]


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s] positions 0..s-1 (right padding keeps real tokens at their true positions)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def model_forward(model: torch.nn.Module, batch: Batch, rows: torch.Tensor | None = None, **extra) -> torch.Tensor:
    """The model (a chunk) on one micro-batch: input_ids [b, s] right-padded -> its last stage's output [b, s, X]
    (logits, scores, or with `labels=` the per-token loss), or [b, T, V/tp] at `rows` [b, T] (models/logit_rows.py);
    earlier pipeline stages return their hidden states.

    A micro-batch with a "pack_width" (set by `pack_widths`) runs packed: its rows end to end as [1, W]
    (models/packing.py) and the last stage's output laid back out in the padded layout, so callers read the
    same shapes either way. Rows < 0 are positions the caller does not read (a response's padding): padded,
    they read position 0; packed, they are not computed at all, the logits come as [1, N, V/tp] for the N rows
    >= 0 in row-major order, and `batch["rows_kept"]` ([b, T] bool) says which (`scatter_rows` lays a result
    over them back out as [b, T])."""
    input_ids = batch["input_ids"]
    width = batch.get("pack_width")
    if packing.first_stage(model):
        real = batch["lengths"].sum() if "lengths" in batch else input_ids.numel()
        packing.count_tokens(real, input_ids.numel() if width is None else width)
    if width is None:
        with logits_at(model, rows.clamp(min=0) if rows is not None else None):
            return model(input_ids, batch.get("position_ids", position_ids_for(input_ids)), None, **extra)
    p = packing.pack(input_ids, batch["lengths"], width=int(width))
    extra = {k: packing.pack_values(v, p) if k == "labels" else v for k, v in extra.items()}
    picked = rows is not None and rows_apply(model)
    at = None
    if picked:
        kept = rows >= 0
        at = packing.pack_rows(rows.clamp(min=0), p)
        if not bool(kept.all()):
            at = at[:, kept.reshape(-1)]
            batch["rows_kept"] = kept
    with logits_at(model, at):
        output = model(p.input_ids, p.position_ids, None, packed_seq_params=p.params, **extra)
    if not packing.last_stage(model):
        return output
    if picked:
        return output if "rows_kept" in batch else output.view(rows.shape[0], rows.shape[1], *output.shape[2:])
    return packing.unpack(output, p, input_ids.shape[1])


def scatter_rows(values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """values [1, N] at the kept rows of a packed forward (`model_forward`) -> [b, T], 0 elsewhere. Differentiable."""
    return torch.zeros(kept.shape, dtype=values.dtype, device=values.device).masked_scatter(kept, values[0])


def pack_widths(microbatches: List[Batch], pipelined: bool) -> List[Batch]:
    """The micro-batches marked to run packed (`model_forward`) when packing is on (models/packing.py
    `configure`), each has its rows' "lengths" and packing removes enough padding (`packing.worth_packing`):
    each pack as wide as its tokens rounded up to the TP size under sequence parallelism (the sequence is split
    over TP ranks), and under a pipeline one width for all (stages exchange activations of one shape; micro-batches
    of unequal row counts always run packed there).
    Otherwise as they are."""
    if not packing.enabled() or not microbatches or any("lengths" not in mb for mb in microbatches):
        return microbatches
    multiple = packing.sequence_multiple()
    widths = [packing.packed_width(mb["lengths"], multiple) for mb in microbatches]
    if pipelined:
        widths = [max(widths)] * len(widths)
    # A pipeline moves activations of one shape, [s, b, H] padded: token-budget micro-batches of unequal row
    # counts run packed ([W, 1, H]) even where packing saves little.
    uniform = not pipelined or len({mb["input_ids"].shape[0] for mb in microbatches}) == 1
    if uniform and not packing.worth_packing(sum(mb["input_ids"].numel() for mb in microbatches), sum(widths)):
        return microbatches
    return [{**mb, "pack_width": w} for mb, w in zip(microbatches, widths)]


def make_forward_step(loss_fn: LossFn, model_kwargs: Callable[[Batch], dict] | None = None,
                      rows: Callable[[Batch], torch.Tensor | None] | None = None):
    """Build the `forward_step(data_iterator, model)` that Megatron's pipeline schedules call.

    `model_kwargs(batch)` adds keyword arguments to the model call (e.g. `labels`). `rows(batch)` ([b, T]
    positions or None): an LM's logits come only at those rows, [b, T, V/tp] (models/logit_rows.py).
    """
    def forward_step(data_iterator, model):
        batch = on_device_of(model, next(data_iterator))
        extra = model_kwargs(batch) if model_kwargs else {}
        output = model_forward(model, batch, rows(batch) if rows else None, **extra)

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
    through its own iterator, as the interleaved schedule expects. With packing on, each runs packed
    (`pack_widths`): the schedule then moves [W, 1, H] activations.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    microbatches = pack_widths(microbatches, pipeline_stages() > 1)
    if "pack_width" in microbatches[0]:
        seq_len, mbs = microbatches[0]["pack_width"], 1
    else:
        seq_len, mbs = max(mb["input_ids"].shape[1] for mb in microbatches), microbatches[0]["input_ids"].shape[0]
        if pipeline_stages() > 1 and any(mb["input_ids"].shape != (mbs, seq_len) for mb in microbatches):
            raise ValueError("pipeline parallelism needs every microbatch of the same rows, padded to the same "
                             "sequence length")
    iterators = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=mbs,
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
