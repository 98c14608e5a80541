"""The supervised training loop shared by SFT, the reward model and DPO (and reused by PPO's pieces).

    validate config + layout -> init distributed -> build model -> initial weights -> DDP + optimizer
    -> resume (exact: weights, optimizer, scheduler, RNG, data cursor, step) -> for each step:
    microbatches -> train_step -> metrics -> eval -> checkpoint; SIGTERM/SIGUSR1 -> checkpoint, exit 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_rlhf.config import schema as C
from megatron_rlhf.data import dataset as D
from megatron_rlhf.data.sampler import ShardedBatchSampler, eval_batches
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.data.collate import COLLATE, dataset_tokens, microbatches
from megatron_rlhf.models import packing
from megatron_rlhf.parallel.cpu import peak_memory_gib
from megatron_rlhf.parallel import init
from megatron_rlhf.trainer.preflight import resume_message
from megatron_rlhf.trainer.run import (
    StopFlag, build_trainable, finished_line, open_metrics, record_run, resume_point, save_or_stop, start_run, write_json,
)
from megatron_rlhf.trainer.step import LossFn, make_forward_step, reduce_stats, run_schedule, train_step


@dataclass
class Stage:
    """What distinguishes SFT from RM training: data kind, head, loss and model inputs."""

    name: str  # model name inside checkpoints: "policy" | "reward"
    data_kind: str  # "sft" | "preference"
    head: str  # "lm" | "scalar"
    loss_fn: LossFn
    stat_names: List[str]
    model_kwargs: Optional[Callable[[dict], dict]] = None
    # Model name to read from `model.load` checkpoints, or names in order of preference
    init_source: ckpt.Sources = "policy"
    # After the last step: extra state for the final checkpoint (e.g. reward calibration), also
    # written to <run_dir>/<key>.json. Called as finalize(cfg, chunks, tokenizer, dp_rank, dp_size, log).
    finalize: Optional[Callable[..., Dict[str, dict]]] = None
    # Inputs a batch needs from outside the trained model (DPO: reference logprobs). Called once, after the
    # data is loaded and before the model is built, as prepare(cfg, ctx, splits, pad_to) -> attach; then
    # attach(split, microbatches, indices) -> microbatches for each train step ("train") and eval ("eval"),
    # `indices` being this rank's dataset rows of those microbatches, in order.
    prepare: Optional[Callable[..., Callable]] = None


def run_stage(cfg, stage: Stage) -> Dict[str, float]:
    """Train one stage to the end (or to a preemption checkpoint). Returns the last eval metrics."""
    ctx = start_run(cfg, lambda dp: C.check_batch_layout(cfg.train, dp))  # one clear error before any work
    from megatron.core import parallel_state as ps

    log, dp_size, tokenizer = ctx.log, ctx.dp_size, ctx.tokenizer
    splits = D.load_splits(stage.data_kind, cfg.data, tokenizer, log=log)
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
    balance = dataset_tokens(splits.train) if packing.enabled() and dp_size > 1 else None  # tokens per example
    sampler = ShardedBatchSampler(len(splits.train), cfg.train.global_batch_size, ctx.dp_rank, dp_size, seed=seed,
                                  lengths=balance)
    total_steps = C.total_train_steps(cfg.train, sampler.steps_per_epoch)
    collate = COLLATE[stage.data_kind]
    pad_to = cfg.data.max_seq_len if cfg.parallel.pp > 1 else None  # pipelines need one shape
    attach = stage.prepare(cfg, ctx, splits, pad_to) if stage.prepare is not None else None

    torch.manual_seed(cfg.train.seed)
    model = build_trainable(cfg, ctx, stage.head, cfg.model.load, stage.init_source, total_steps)
    chunks, optimizer, scheduler = model.chunks, model.optimizer, model.scheduler
    models, optimizers, schedulers = {stage.name: chunks}, {stage.name: optimizer}, {stage.name: scheduler}

    ckpt_root = ctx.ckpt_root
    step, resumed_extra = 0, {}
    resume_from = resume_point(cfg, ctx)
    if resume_from is not None:
        resumed_extra = ckpt.load_checkpoint(resume_from, models, optimizers, schedulers)
        step = int(resumed_extra["step"])
        sampler.load_state_dict(resumed_extra["data"])
        if log:
            log(resume_message(resume_from, step, total_steps, cfg.train.exit_at_step))
    record_run(cfg, ctx)

    def save(at_step: int, more: Optional[dict] = None):
        ckpt.save_checkpoint(ckpt_root, at_step, models, optimizers, schedulers,
                             {"data": sampler.state_dict(), **(more or {})}, keep_last=cfg.checkpoint.keep_last,
                             run=ctx.run)

    forward_step = make_forward_step(stage.loss_fn, stage.model_kwargs)
    metrics = open_metrics(cfg, ctx, total_steps, step)
    first_step, started = step, time.monotonic()
    stop = StopFlag()
    stop_at = min(total_steps, cfg.train.exit_at_step or total_steps)
    last_eval: Dict[str, float] = {}
    saved_at = step if resume_from is not None else -1
    while step < stop_at:
        indices = next(sampler)
        mbs = microbatches(splits.train, indices, cfg.train.micro_batch_size, collate,
                           max_tokens=cfg.train.max_tokens_per_micro_batch, packed=packing.enabled(),
                           pad_id=tokenizer.pad_token_id, pad_to=pad_to, multiple_of=packing.sequence_multiple())
        packing.take_real_token_fraction()  # the tally of this step's forwards starts here
        with metrics.timer("time/step") as timing:
            if attach is not None:  # inside the timer: an online reference forward is part of the step
                mbs = attach("train", mbs, indices)
            stats = train_step(chunks, optimizer, scheduler, mbs, forward_step)
        step += 1
        tokens = sum(int(mb["lengths"].sum()) for mb in mbs) * dp_size  # estimate: equal shares per DP rank
        perf = {"perf/tokens_per_step": tokens, "perf/peak_memory_gib": peak_memory_gib()}
        if timing.seconds:
            perf["perf/tokens_per_s"] = tokens / timing.seconds
        fraction = packing.take_real_token_fraction()  # this rank's forwards: the share that was not padding
        if fraction is not None:
            perf["perf/real_token_fraction"] = fraction
        metrics.log_step(step, {f"train/{k}": v for k, v in stats.items()} | perf, last=step == stop_at)
        evaluate_now = cfg.train.eval_interval and step % cfg.train.eval_interval == 0
        if splits.eval is not None and (evaluate_now or step == total_steps):
            last_eval = evaluate(chunks, splits.eval, stage, cfg, tokenizer, dp_size, pad_to, attach)
            metrics.log(step, {f"eval/{k}": v for k, v in last_eval.items()})
        done = save_or_stop(cfg, step, stop, save, metrics, log)
        if done == "stopped":
            return last_eval
        saved_at = step if done == "saved" else saved_at
    final = {}
    if stage.finalize is not None and step == total_steps and not resumed_extra.get("finalized"):
        final = stage.finalize(cfg, chunks, tokenizer, ps.get_data_parallel_rank(), dp_size, log)
        for key, value in final.items():
            metrics.log(step, {f"eval/{key}_{k}": v for k, v in value.items() if isinstance(v, (int, float))})
            if ctx.rank0:
                write_json(f"{cfg.logging.run_dir}/{key}.json", value)
        if final:
            final["finalized"] = True  # a rerun after the last step does not repeat it
    if saved_at != step or final:
        save(step, final)
    metrics.close()
    if log:
        log(finished_line(cfg, "step", first_step, step, total_steps, time.monotonic() - started))
    result = dict(last_eval)
    init.destroy()
    return result


@torch.no_grad()
def evaluate(chunks, dataset, stage: Stage, cfg, tokenizer, dp_size: int, pad_to, attach=None) -> Dict[str, float]:
    """Forward-only pass over the whole held-out set; sums reduced over DP ranks, divided once."""
    from megatron.core import parallel_state as ps

    for c in chunks:
        c.eval()
    outputs = []
    forward_step = make_forward_step(stage.loss_fn, stage.model_kwargs)
    for indices in eval_batches(len(dataset), cfg.train.global_batch_size, ps.get_data_parallel_rank(), dp_size):
        for start in range(0, len(indices), cfg.train.micro_batch_size):
            part = indices[start: start + cfg.train.micro_batch_size]
            mbs = microbatches(dataset, part, len(part), COLLATE[stage.data_kind],
                                 pad_id=tokenizer.pad_token_id, pad_to=pad_to, multiple_of=packing.sequence_multiple())
            if attach is not None:
                mbs = attach("eval", mbs, part)
            outputs += run_schedule(chunks, mbs, forward_step, forward_only=True)
    for c in chunks:
        c.train()
    return reduce_stats(outputs, names=stage.stat_names)
