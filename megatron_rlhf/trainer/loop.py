"""The supervised training loop shared by SFT and the reward model (and reused by PPO's pieces).

    validate config + layout -> init distributed -> build model -> initial weights -> DDP + optimizer
    -> resume (exact: weights, optimizer, scheduler, RNG, data cursor, step) -> for each step:
    microbatches -> train_step -> metrics -> eval -> checkpoint; SIGTERM/SIGUSR1 -> checkpoint, exit 0.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_rlhf import config as C
from megatron_rlhf import data as D
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.metrics import peak_memory_gib
from megatron_rlhf.models.build import build_model
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import validate_layout
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.preflight import check_run_dirs, resume_message
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
    init_source: str = "policy"  # model name to read from `model.load` checkpoints
    # After the last step: extra state for the final checkpoint (e.g. reward calibration), also
    # written to <run_dir>/<key>.json. Called as finalize(cfg, chunks, tokenizer, dp_rank, dp_size, log).
    finalize: Optional[Callable[..., Dict[str, dict]]] = None


class _StopFlag:
    """SIGTERM / SIGUSR1 (Slurm preemption) ask for a checkpoint and a clean exit."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def any_rank(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def _metrics(cfg, total_steps: int, start_step: int, rank0: bool):
    from megatron_rlhf.metrics import MetricsLogger

    return MetricsLogger(
        cfg.logging.run_dir,
        enabled=rank0,
        total_steps=total_steps,
        start_step=start_step,
        tensorboard=cfg.logging.tensorboard,
        progress_bar=cfg.logging.progress_bar,
        config_text=C.to_yaml(cfg),
        log_interval=cfg.logging.log_interval,
    )


def run_stage(cfg, stage: Stage) -> Dict[str, float]:
    """Train one stage to the end (or to a preemption checkpoint). Returns the last eval metrics."""
    check_run_dirs(cfg)  # before any slow work
    model_cfg = cfg.model.to_model_config()
    world = init.world_size_from_env()
    validate_layout(
        cfg.parallel, world, num_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads, num_query_groups=model_cfg.num_query_groups,
        fp8=cfg.fp8,
    )
    dp_size = cfg.parallel.dp(world)
    C.check_batch_layout(cfg.train, dp_size)  # one clear error before any work
    init.initialize(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as ps

    rank0 = torch.distributed.get_rank() == 0
    log = print if rank0 else None
    tokenizer = D.load_tokenizer(cfg.tokenizer.path)
    D.check_vocab(tokenizer, model_cfg.vocab_size)
    splits = D.load_splits(stage.data_kind, cfg.data, tokenizer, log=log)
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
    sampler = D.ShardedBatchSampler(
        len(splits.train), cfg.train.global_batch_size, ps.get_data_parallel_rank(), dp_size, seed=seed
    )
    total_steps = C.total_train_steps(cfg.train, sampler.steps_per_epoch)
    collate = D.COLLATE[stage.data_kind]
    pad_to = cfg.data.max_seq_len if cfg.parallel.pp > 1 else None  # pipelines need one shape

    torch.manual_seed(cfg.train.seed)
    chunks = build_model(model_cfg, cfg.parallel, head=stage.head, fp8=cfg.fp8)
    if cfg.model.load:
        ckpt.load_model_weights(cfg.model.load, chunks, stage.init_source, stage.head)
    chunks = wrap_ddp(chunks, cfg.parallel.use_distributed_optimizer)
    optimizer, scheduler = build_optimizer(chunks, cfg.train, cfg.parallel.use_distributed_optimizer, total_steps)
    models, optimizers, schedulers = {stage.name: chunks}, {stage.name: optimizer}, {stage.name: scheduler}

    ckpt_root = cfg.checkpoint.dir or f"{cfg.logging.run_dir}/checkpoints"
    step, resumed_extra = 0, {}
    resume_from = ckpt.latest_checkpoint(cfg.checkpoint.load or ckpt_root) if cfg.checkpoint.resume != "never" else None
    if cfg.checkpoint.resume == "required" and resume_from is None:
        raise ckpt.CheckpointError(f"checkpoint.resume=required but {cfg.checkpoint.load or ckpt_root} has no checkpoint")
    if resume_from is not None:
        resumed_extra = ckpt.load_checkpoint(resume_from, models, optimizers, schedulers)
        step = int(resumed_extra["step"])
        sampler.load_state_dict(resumed_extra["data"])
        if log:
            log(resume_message(resume_from, step, total_steps, cfg.train.exit_at_step))
    if rank0:
        C.save_resolved(cfg, cfg.logging.run_dir)
        # Later stages (`model.load`) read the architecture from here.
        C.write_model_config(model_cfg, ckpt_root)

    def save(at_step: int, more: Optional[dict] = None):
        ckpt.save_checkpoint(ckpt_root, at_step, models, optimizers, schedulers,
                             {"data": sampler.state_dict(), **(more or {})}, keep_last=cfg.checkpoint.keep_last)

    forward_step = make_forward_step(stage.loss_fn, stage.model_kwargs)
    metrics = _metrics(cfg, total_steps, step, rank0)
    stop = _StopFlag()
    stop_at = min(total_steps, cfg.train.exit_at_step or total_steps)
    last_eval: Dict[str, float] = {}
    saved_at = step if resume_from is not None else -1
    while step < stop_at:
        indices = next(sampler)
        mbs = D.microbatches(splits.train, indices, cfg.train.micro_batch_size, collate,
                             pad_id=tokenizer.pad_token_id, pad_to=pad_to)
        with metrics.timer("time/step") as timing:
            stats = train_step(chunks, optimizer, scheduler, mbs, forward_step)
        step += 1
        tokens = sum(int(mb["lengths"].sum()) for mb in mbs) * dp_size  # estimate: equal shares per DP rank
        perf = {"perf/tokens_per_step": tokens, "perf/peak_memory_gib": peak_memory_gib()}
        if timing.seconds:
            perf["perf/tokens_per_s"] = tokens / timing.seconds
        metrics.log_step(step, {f"train/{k}": v for k, v in stats.items()} | perf, last=step == stop_at)
        evaluate_now = cfg.train.eval_interval and step % cfg.train.eval_interval == 0
        if splits.eval is not None and (evaluate_now or step == total_steps):
            last_eval = evaluate(chunks, splits.eval, stage, cfg, tokenizer, dp_size, pad_to)
            metrics.log(step, {f"eval/{k}": v for k, v in last_eval.items()})
        if stop.any_rank():
            save(step)
            if log:
                log(f"stop requested: saved checkpoint at step {step}, exiting")
            metrics.close()
            init.destroy()
            return last_eval
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            save(step)
            saved_at = step
    final = {}
    if stage.finalize is not None and step == total_steps and not resumed_extra.get("finalized"):
        final = stage.finalize(cfg, chunks, tokenizer, ps.get_data_parallel_rank(), dp_size, log)
        for key, value in final.items():
            metrics.log(step, {f"eval/{key}_{k}": v for k, v in value.items() if isinstance(v, (int, float))})
            if rank0:
                _write_json(f"{cfg.logging.run_dir}/{key}.json", value)
        if final:
            final["finalized"] = True  # a rerun after the last step does not repeat it
    if saved_at != step or final:
        save(step, final)
    metrics.close()
    result = dict(last_eval)
    init.destroy()
    return result


def _write_json(path: str, value: dict) -> None:
    import json
    import os

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(chunks, dataset, stage: Stage, cfg, tokenizer, dp_size: int, pad_to) -> Dict[str, float]:
    """Forward-only pass over the whole held-out set; sums reduced over DP ranks, divided once."""
    from megatron.core import parallel_state as ps

    for c in chunks:
        c.eval()
    outputs = []
    forward_step = make_forward_step(stage.loss_fn, stage.model_kwargs)
    for indices in D.eval_batches(len(dataset), cfg.train.global_batch_size, ps.get_data_parallel_rank(), dp_size):
        for start in range(0, len(indices), cfg.train.micro_batch_size):
            part = indices[start: start + cfg.train.micro_batch_size]
            mbs = D.microbatches(dataset, part, len(part), D.COLLATE[stage.data_kind],
                                 pad_id=tokenizer.pad_token_id, pad_to=pad_to)
            outputs += run_schedule(chunks, mbs, forward_step, forward_only=True)
    for c in chunks:
        c.train()
    return reduce_stats(outputs, names=stage.stat_names)
