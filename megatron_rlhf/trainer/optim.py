"""Trainable model = Megatron DDP-wrapped chunks + Megatron optimizer + LR/WD scheduler.

Losses are normalised once, globally: model configs use `calculate_per_token_loss`, so loss
functions return token SUMS with their token counts; `finalize_grads` all-reduces the total count over
data-parallel ranks, and `optimizer_step` divides the gradients by it. Results therefore do not
depend on DP size or on how the batch is cut into microbatches.

One optimizer step reads the gradients twice: once for their norm (clipping, the non-finite check and
the reported `grad_norm` all come from it) and once in Adam, which also applies the token-count division
and the clipping factor (torch's fused Adam takes them as its `grad_scale`). Megatron's own `step()`
after its `finalize_model_grads` makes three more passes over them: the division, the finite check and
the clipping's multiply (each a pass over 2 x 540 MB per step of a 135M fp32 model).
"""

from __future__ import annotations

import math
import weakref
from typing import List, Optional, Tuple

import torch

from megatron_rlhf.parallel import cpu, grad_buffer
from megatron_rlhf.parallel.layout import GRAD_REDUCE_IN_FP32


def wrap_ddp(chunks: List[torch.nn.Module], use_distributed_optimizer: bool,
             check_for_nan_in_grad: bool = True) -> List[torch.nn.Module]:
    """Megatron DDP around each chunk, with per-token loss normalisation switched on.

    `check_for_nan_in_grad=False` when the caller checks gradients itself and skips bad steps (PPO).
    On CPU the linear layers then add their weight gradients straight into DDP's buffer (parallel/cpu.py
    `fuse_grad_accumulation`).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=GRAD_REDUCE_IN_FP32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=check_for_nan_in_grad,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        chunk.config.calculate_per_token_loss = True
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk uses buckets smaller than the whole model (megatron's rule for VPP).
                disable_bucketing=i > 0,
            )
        )
        cpu.fuse_grad_accumulation(chunk)
    return wrapped


def build_optimizer(chunks: List[torch.nn.Module], cfg, use_distributed_optimizer: bool, total_steps: int):
    """Megatron Adam (distributed optimizer if asked) + OptimizerParamScheduler; wires the schedule hooks.

    `cfg` is the `train` config group (config.TrainConfig): lr, min_lr, lr_schedule, warmup_steps,
    lr_decay_steps (None: all `total_steps`), weight_decay, adam_*, clip_grad.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    tconf = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=tconf.bf16,
        fp16=tconf.fp16,
        params_dtype=tconf.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    use_fused_adam(optimizer)
    decay_steps = cfg.lr_decay_steps or total_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.lr_schedule != "constant" else cfg.lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=max(decay_steps, cfg.warmup_steps + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    for chunk in chunks:
        c = chunk.config
        c.finalize_model_grads_func = finalize_grads
        c.grad_scale_func = _weak_method(optimizer.scale_loss)
        c.no_sync_func = [m.no_sync for m in chunks] if len(chunks) > 1 else chunks[0].no_sync
        if use_distributed_optimizer:
            c.param_sync_func = None  # params are gathered at the end of optimizer.step()
    return optimizer, scheduler


def _weak_method(method):
    """`method` called through a weak reference to its object. The model's config must not keep its
    distributed optimizer alive: through that edge the two formed a cycle the garbage collector cannot see
    whole (it runs through tensors that autograd's C++ side also holds), so a dropped model and optimizer,
    and the process groups they hold with their gloo threads, stayed alive until the process ended."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        return ref()(*args, **kwargs)
    return call


def use_fused_adam(optimizer) -> None:
    """Switch the torch Adam(W) inside a Megatron optimizer to its fused kernel (one pass over parameter,
    gradient and both moments instead of about ten foreach passes; on 2 CPU threads a step over 135M fp32
    parameters takes 0.09 s instead of 0.41 s). Megatron builds torch's AdamW with the foreach default when
    neither Transformer Engine nor Apex is installed; their fused Adams are left alone.

    Loading optimizer state keeps the choice (checkpoint/optim_state.py puts the run's flags back after
    `load_state_dict`, which takes the checkpoint's param groups whole)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, torch.optim.Adam):  # AdamW subclasses Adam
            continue
        for group in torch_opt.param_groups:
            if all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in group["params"]):
                group["foreach"], group["fused"] = False, True


def finalize_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None, pg_collection=None,
                   force_all_reduce: bool = False) -> None:
    """The schedules' `finalize_model_grads_func`: Megatron's `finalize_model_grads` (data-parallel all-reduce,
    tied and sequence-parallel gradients) without its last pass, the division by the global token count. That
    count is reduced as Megatron reduces it (from the last pipeline stage, summed over data-parallel ranks) and
    left on each chunk as `pending_grad_scale` for `optimizer_step`. First, gradients that no write of the step
    reached are zeroed (`grad_buffer.settle`: the buffers are zeroed by their first write on CPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.utils import get_pp_last_rank

    grad_buffer.settle(model)
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    scale = 1.0
    if num_tokens is not None:
        pp_group = pg_collection.pp if pg_collection is not None else ps.get_pipeline_model_parallel_group()
        dp_cp_group = (pg_collection.dp_cp if pg_collection is not None
                       else ps.get_data_parallel_group(with_context_parallel=True))
        torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)
        torch.distributed.all_reduce(num_tokens, group=dp_cp_group)
        if num_tokens > 0:
            scale = 1.0 / float(num_tokens)
    for chunk in model:
        chunk.pending_grad_scale = scale


def optimizer_step(optimizer, chunks: List[torch.nn.Module], skip_nonfinite: bool = False) -> Tuple[bool, Optional[float]]:
    """One step of a Megatron optimizer on the gradients `finalize_grads` left: returns (stepped, grad_norm).

    grad_norm is the norm of the token-normalised gradients before clipping (what Megatron reports). The
    gradients are multiplied by 1/tokens x min(1, clip_grad / grad_norm) inside Adam's own pass. A non-finite
    norm on a step that `skip_nonfinite` guards skips it when some gradient element is NaN or Inf (the norm
    alone cannot tell them from finite values whose squares overflow): weights, moments and schedule untouched.
    Without the guard the step goes on as Megatron's would. An fp16 loss-scale overflow skips as in Megatron.
    """
    grad_buffer.settle(chunks)  # where the schedule's finalize_grads did not run
    scale = 1.0
    for chunk in chunks:
        scale = getattr(chunk, "pending_grad_scale", scale)
        chunk.pending_grad_scale = 1.0
    if optimizer.prepare_grads():  # fp16: the loss scaler found an overflow (and has lowered its scale)
        return False, None
    grad_norm = optimizer.get_grad_norm() * scale  # every rank gets the same value (Megatron reduces it)
    if skip_nonfinite and not math.isfinite(grad_norm) and not grads_finite(chunks):
        return False, float("nan")
    factor = scale
    clip = optimizer.config.clip_grad
    if clip > 0.0 and clip / (grad_norm + 1.0e-6) < 1.0:  # Megatron's rule; False for a NaN norm
        factor *= clip / (grad_norm + 1.0e-6)
    inners = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
              if not getattr(o, "is_stub_optimizer", False) and o.get_parameters()]
    scaled_in_adam = []
    try:
        for inner in inners if factor != 1.0 else []:
            torch_opt = getattr(inner, "optimizer", None)
            if _fused_torch_adam(torch_opt) and factor > 0.0:
                torch_opt.grad_scale = torch.tensor(1.0 / factor)  # Adam divides each gradient by it as it reads it
                scaled_in_adam.append(torch_opt)
                continue
            attr = "decoupled_grad" if inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 else "grad"
            grads = [getattr(p, attr) for p in inner.get_parameters() if getattr(p, attr, None) is not None]
            torch._foreach_mul_(grads, factor)
        stepped = optimizer.step_with_ready_grads()
    finally:
        for torch_opt in scaled_in_adam:
            del torch_opt.grad_scale
    return stepped, grad_norm


def _fused_torch_adam(torch_opt) -> bool:
    """True for a torch Adam(W) whose every group runs the fused kernel (`use_fused_adam`), which takes a
    `grad_scale`; other optimizers (TE's, Apex's, foreach) get their gradients multiplied first."""
    return isinstance(torch_opt, torch.optim.Adam) and all(g.get("fused") for g in torch_opt.param_groups)


def grads_finite(chunks) -> bool:
    """True when every gradient of every rank is finite (one MAX all-reduce over the world).

    A Megatron DDP chunk is checked through its flat gradient buffers, a plain module through each .grad.
    Fast path: a sum is non-finite whenever one of its elements is (NaN, +-inf), and summing is ~40x cheaper
    than `isfinite().all()` over every element (which was ~3% of a PPO iteration on the benchmark's small
    model). A sum of finite fp32 values can still overflow, so only then are the elements checked one by one.
    """
    grads = []
    for chunk in chunks:
        buffers = grad_buffer.ddp_buffers(chunk)  # Megatron DDP: every gradient lives in a few flat buffers
        if buffers:
            grads.extend(b.grad_data for b in buffers)
            continue
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = torch.zeros(1, device=device)
    if grads and not bool(torch.isfinite(torch.stack([g.sum() for g in grads])).all()):
        bad = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float().reshape(1)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())
