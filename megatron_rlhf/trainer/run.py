"""Run infrastructure shared by the supervised loop (SFT, RM) and PPO: one copy of each set-up step.

    ctx = start_run(cfg, check_batch)        # layout check, batch check, process groups, tokenizer
    policy = build_trainable(ctx, ...)       # model -> initial weights -> DDP -> optimizer + scheduler
    path = resume_point(cfg, ctx, log)       # the checkpoint to resume from (or None)
    record_run(cfg, ctx)                     # resolved config.yaml, model_config.json (+ generation_config.json)
    stop = StopFlag()                        # SIGTERM / SIGUSR1 -> checkpoint and a clean exit
    metrics = open_metrics(cfg, ctx, ...)    # TensorBoard + metrics.jsonl + progress bar on rank 0
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import torch

from megatron_rlhf.config import generation as G
from megatron_rlhf.config import model_file
from megatron_rlhf.config import schema as C
from megatron_rlhf.config import io as config_io
from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.checkpoint import run_dir
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.models.build import build_model
from megatron_rlhf.parallel import cpu, init, lifetime
from megatron_rlhf.parallel.layout import validate_layout
from megatron_rlhf.parallel.report import first_problem
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.preflight import check_run_dirs


@dataclass
class RunContext:
    """What every stage knows after `start_run`: layout, ranks, tokenizer, where checkpoints go."""

    model_cfg: Any  # models.spec.ModelConfig
    world: int
    dp_size: int
    dp_rank: int
    rank0: bool
    log: Optional[Callable[[str], None]]  # print on rank 0, None elsewhere
    tokenizer: Any
    ckpt_root: str
    run: ckpt.RunRecord  # stage + run id, recorded in each checkpoint; a resumed run takes its checkpoint's id


@dataclass
class Trainable:
    """A trained model: DDP-wrapped chunks, its optimizer and LR scheduler."""

    chunks: List[torch.nn.Module]
    optimizer: Any
    scheduler: Any


def start_run(cfg, check_batch: Callable[[int], Any]) -> RunContext:
    """Validate the layout and the batch split (`check_batch(dp_size)`), then initialise
    torch.distributed + Megatron's groups and load the tokenizer. Bad input fails before any work."""
    check_run_dirs(cfg)  # an unwritable run directory fails now, not at the first checkpoint
    model_cfg = cfg.model.to_model_config()
    world = init.world_size_from_env()
    validate_layout(
        cfg.parallel, world, num_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads, num_query_groups=model_cfg.num_query_groups,
        fp8=cfg.fp8,
    )
    dp_size = cfg.parallel.dp(world)
    check_batch(dp_size)
    init.initialize(cfg.parallel, seed=cfg.train.seed)
    configure_packing(cfg)
    from megatron.core import parallel_state as ps

    rank0 = torch.distributed.get_rank() == 0
    _lock_run_dirs(cfg, rank0)
    tokenizer = T.load_tokenizer(cfg.tokenizer.path)
    T.check_vocab(tokenizer, model_cfg.vocab_size)
    if rank0 and G.note(cfg):
        print(G.note(cfg), flush=True)  # which sampling settings came from the checkpoint's generation_config.json
    slow_dtype = cpu.slow_dtype_warning(model_cfg.params_dtype)  # bf16 without the CPU's bf16 instructions
    if rank0 and slow_dtype:
        print(slow_dtype, flush=True)
    ckpt_root = cfg.checkpoint.dir or f"{cfg.logging.run_dir}/checkpoints"
    # Where a rerun resumes from (as resume_point reads it), for the launcher's line when a rank is killed.
    lifetime.note_checkpoint_root(cfg.checkpoint.load or ckpt_root)
    return RunContext(
        model_cfg=model_cfg, world=world, dp_size=dp_size, dp_rank=ps.get_data_parallel_rank(), rank0=rank0,
        log=print if rank0 else None, tokenizer=tokenizer, ckpt_root=ckpt_root,
        run=ckpt.RunRecord.new(stage_of(cfg), T.fingerprint(tokenizer)),
    )


def configure_packing(cfg) -> None:
    """`train.packing` for this process's forwards (models/packing.py): on where it is exact, i.e. without context
    parallelism (a packed sequence split over CP ranks needs Transformer Engine's load-balanced THD split)."""
    from megatron_rlhf.models import packing

    p = cfg.parallel
    packing.configure(cfg.train.packing and p.cp == 1, p.tp if p.sequence_parallel else 1)


def expected_tokenizer(cfg, tokenizer, setting: str = "tokenizer.path") -> Optional[dict]:
    """The tokenizer fingerprint every checkpoint this run loads must match (`ckpt.check_tokenizer`);
    None (no check) with tokenizer.allow_swap=true. `setting`: the one that names `tokenizer`, for the error
    (`ppo.reward_tokenizer` for a reward model with a tokenizer of its own)."""
    if cfg.tokenizer.allow_swap:
        return None
    found = T.fingerprint(tokenizer)
    return found if setting == "tokenizer.path" else {**found, "setting": setting}


def stage_of(cfg) -> str:
    """The stage a config belongs to (its command: sft, rm, ppo, dpo), as checkpoints record it."""
    return type(cfg).__name__.removesuffix("Config").lower()


def _lock_run_dirs(cfg, rank0: bool) -> None:
    """Rank 0 locks the run directory (and checkpoint.dir when set apart) for the run's lifetime; every rank
    raises the same one line when another run holds either. Collective."""
    busy = None
    if rank0:
        busy = run_dir.lock_dir(cfg.logging.run_dir, "logging.run_dir")
        if busy is None and cfg.checkpoint.dir:
            busy = run_dir.lock_dir(cfg.checkpoint.dir, "checkpoint.dir")
    busy = first_problem(busy)
    if busy:
        raise C.ConfigError(busy)


def build_frozen(cfg, ctx: RunContext, head: str, load: Optional[str], source_name: ckpt.Sources, *,
                 skip_head: bool = False, key: Optional[str] = None, model_cfg=None,
                 tokenizer=None, tokenizer_setting: str = "tokenizer.path") -> List[torch.nn.Module]:
    """Model chunks in the training layout with weights from `load` (model `source_name` in it; `key`: the
    setting `load` came from, for errors). `model_cfg`: its architecture (default: the policy's, ctx.model_cfg);
    `tokenizer`: the one its checkpoint must have been trained with (default: the run's, ctx.tokenizer), named
    by `tokenizer_setting`."""
    model_cfg = model_cfg or ctx.model_cfg
    if not load:
        return build_model(model_cfg, cfg.parallel, head=head, fp8=cfg.fp8)
    return ckpt.load_model(load, model_cfg, cfg.parallel, source_name, head, fp8=cfg.fp8, skip_head=skip_head,
                           key=key, tokenizer=expected_tokenizer(cfg, tokenizer or ctx.tokenizer, tokenizer_setting))


def build_trainable(cfg, ctx: RunContext, head: str, load: Optional[str], source_name: ckpt.Sources,
                    total_steps: int, *, train_cfg=None, skip_head: bool = False, check_for_nan_in_grad: bool = True,
                    key: Optional[str] = None, model_cfg=None) -> Trainable:
    """Model -> initial weights (`load`, or fresh) -> Megatron DDP -> optimizer + scheduler.

    `train_cfg` (default `cfg.train`) gives lr, schedule, Adam and clipping settings; `model_cfg` the architecture
    (default: the policy's).
    """
    chunks = build_frozen(cfg, ctx, head, load, source_name, skip_head=skip_head, key=key, model_cfg=model_cfg)
    chunks = wrap_ddp(chunks, cfg.parallel.use_distributed_optimizer, check_for_nan_in_grad=check_for_nan_in_grad)
    optimizer, scheduler = build_optimizer(chunks, train_cfg or cfg.train, cfg.parallel.use_distributed_optimizer,
                                           total_steps)
    return Trainable(chunks, optimizer, scheduler)


def resume_point(cfg, ctx: RunContext):
    """The checkpoint directory to resume from, or None (fresh start); honours `checkpoint.resume`.

    Resuming continues the run id of the checkpoint (recording this run's tokenizer); only this stage's
    checkpoints trained with this tokenizer are resumed from, and a fresh start refuses a directory holding
    checkpoints (unless checkpoint.overwrite moves them aside)."""
    key = "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir"
    found = None
    if cfg.checkpoint.resume != "never":
        root = cfg.checkpoint.load or ctx.ckpt_root
        found = ckpt.latest_checkpoint(root)
        if cfg.checkpoint.resume == "required" and found is None:
            raise ckpt.CheckpointError(f"checkpoint.resume=required but {root} has no checkpoint")
    if found is not None:
        where = "checkpoint.load" if cfg.checkpoint.load else key
        record = run_dir.check_resumable(found, ctx.run.stage, where)
        ckpt.check_tokenizer(found, None if cfg.tokenizer.allow_swap else ctx.run.tokenizer, where)
        if record is not None:
            ctx.run = replace(record, tokenizer=ctx.run.tokenizer)
        return found
    run_dir.check_fresh_start(Path(ctx.ckpt_root), ctx.run.stage, key, cfg.checkpoint.overwrite, ctx.rank0, ctx.log)
    torch.distributed.barrier()  # rank 0 has moved the old checkpoints aside before anyone writes
    return None


def record_run(cfg, ctx: RunContext) -> None:
    """Rank 0: the resolved config in the run dir; model_config.json and generation_config.json where later
    stages look for them (next to the checkpoints)."""
    if ctx.rank0:
        C.save_resolved(cfg, cfg.logging.run_dir)
        model_file.write_model_config(ctx.model_cfg, ctx.ckpt_root)
        if isinstance(cfg, C.PPOConfig):  # a later ppo.value_load of this run builds its critic from it
            from megatron_rlhf.config.stage_models import VALUE_MODEL_CONFIG_FILE, other_models

            value = [m.arch for m in other_models(cfg) if m.name == "value"]
            if value:
                model_file.write_model_config(value[0], ctx.ckpt_root, VALUE_MODEL_CONFIG_FILE)
        gen = generation_config(cfg, ctx.tokenizer)
        if gen is not None:
            os.makedirs(ctx.ckpt_root, exist_ok=True)
            write_json(os.path.join(ctx.ckpt_root, G.GENERATION_CONFIG), gen)


def generation_config(cfg, tokenizer) -> Optional[dict]:
    """The generation_config.json of the model this run trains (config/generation.py `for_export`): the one of
    its checkpoint (model.load, model.hf_config) with the tokenizer's token ids; a PPO run's also holds the
    sampling it trained with (ppo.temperature, top_k, top_p, max_new_tokens). None: nothing to write (a stage
    that does not sample, from a checkpoint without one)."""
    path = G.find_generation_config(cfg.model.load, cfg.model.hf_config)
    base = G.read_generation_config(path) if path else None
    p = cfg.ppo if isinstance(cfg, C.PPOConfig) else None
    sampling = None if p is None else {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                                       "max_new_tokens": p.max_new_tokens}
    if base is None and sampling is None:
        return None
    return G.for_export(base, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, sampling)


class StopFlag:
    """SIGTERM / SIGUSR1 (Slurm preemption) / SIGINT (Ctrl-C) ask for a checkpoint and a clean exit.

    The rank's watchdog (parallel/watchdog.py) sees the same signals even while the main thread is wedged:
    it ends a job that cannot reach the next stop check, and exits at once on a second Ctrl-C."""

    def __init__(self):
        self.requested = lifetime.stop_requested()  # caught since the CLI started: a stop during start-up counts
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def any_rank(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def save_or_stop(cfg, step: int, stop: StopFlag, save: Callable[[int], None], metrics, log, unit: str = "step") -> str:
    """After a step: on a stop request on any rank, save, close and return "stopped" (the caller returns);
    else save when `checkpoint.save_interval` is due ("saved"; "stopped" when a stop came during that save: the
    checkpoint just written is the stop's, and a preempted job spends no more step and save of its grace time);
    else "". Collective."""
    if stop.any_rank():
        save(step)
    elif cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
        save(step)
        if not stop.any_rank():
            return "saved"
    else:
        return ""
    if log:
        log(f"stop requested: saved checkpoint at {unit} {step}, exiting")
        note = os.environ.get("STOPPED_FILE")  # slurm/node.sh requeues the job only after such a note
        if note:
            with open(note, "w") as fh:
                fh.write(f"{unit} {step}\n")
    metrics.close()
    init.destroy()
    return "stopped"


def finished_line(cfg, unit: str, first: int, last: int, total: int, seconds: float) -> str:
    """The last line of a stage that ran to its end (rank 0 prints it): what this run trained and where it wrote
    it, so that a job's log says where its results are (the log has no step line when the bar is off).
    `first`: the step (or iteration) the run started from; `last`: the one it ended at, of `total`."""
    if last == first:
        trained = f"trained no {unit}: the run was already at {unit} {last} of {total}"
    else:
        trained = f"trained {unit}s {first + 1}-{last} of {total} in {seconds:.1f} s"
    return f"{stage_of(cfg)}: {trained}; run directory {os.path.abspath(cfg.logging.run_dir)}"


def open_metrics(cfg, ctx: RunContext, total_steps: int, start_step: int,
                 namespaces: Optional[Sequence[str]] = None, desc: str = "train"):
    """The rank-0 MetricsLogger of this run (a no-op object on other ranks)."""
    from megatron_rlhf.trainer.metrics import NAMESPACES, MetricsLogger

    return MetricsLogger(
        cfg.logging.run_dir, enabled=ctx.rank0, total_steps=total_steps, start_step=start_step,
        tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar, config_text=config_io.to_yaml(cfg),
        namespaces=tuple(namespaces or NAMESPACES), desc=desc, log_interval=cfg.logging.log_interval,
    )


def write_json(path: str, value: dict) -> None:
    """Atomic JSON write (rank 0 calls it). A non-finite number becomes null: `NaN` is not JSON, and a
    summary.json that other tools cannot parse loses the whole run's result."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite_or_null(value), f, indent=2, allow_nan=False)
    os.replace(tmp, path)


def append_jsonl(path: str, rows: Sequence[dict]) -> None:
    """Append one JSON line per row (rank 0 calls it), non-finite numbers as null (as `write_json`). Readers of an
    appended file keep the last rows per step: a resumed run repeats the steps after its checkpoint."""
    with open(path, "a") as f:
        f.writelines(json.dumps(_finite_or_null(r), allow_nan=False) + "\n" for r in rows)


def _finite_or_null(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def with_lr(train_cfg, lr: Optional[float]):
    """A copy of the `train` group with another peak lr (None: unchanged)."""
    if lr is None:
        return train_cfg
    return replace(train_cfg, lr=lr, min_lr=min(train_cfg.min_lr, lr))
