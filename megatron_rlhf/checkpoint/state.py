"""Distributed, atomic, resumable training checkpoints.

Layout under the checkpoint root:

    step_00000040/            one complete checkpoint (Megatron `torch_dist` + per-rank RNG files)
        rng/rank00000.pt      torch CPU (and CUDA) generator states of each rank
        ...
    latest                    text file naming the newest complete checkpoint; written last

A checkpoint is written into `.tmp-step_XXXXXXXX`, renamed when every rank has finished, and
only then does `latest` move (atomic `os.replace`). A crash at any point leaves the previous
checkpoint valid and `latest` pointing to it. The last `keep_last` checkpoints of this run are
kept: each step directory records the stage, the run and the tokenizer that wrote it (`run.json`), and pruning
removes only older steps of the same run, so a directory shared by mistake never loses another
run's checkpoints, nor the one just written.

What is saved: each named model (all its chunks), each named optimizer (a distributed optimizer as each
rank's shard: optim_state.py) and scheduler, plus `extra`: any picklable state that is
the same on every rank (step, data cursor, KL controller, ...). RNG states are per rank.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from megatron_rlhf.checkpoint import optim_state, sharding
from megatron_rlhf.checkpoint.damage import (  # noqa: F401 - CheckpointError is imported from here
    CheckpointError,
    _load_failures,
    check_metadata,
    load_rng_collectively,
    unusable_checkpoint_message,
)
from megatron_rlhf.checkpoint.record import (  # noqa: F401 - RunRecord and check_tokenizer are imported from here
    LATEST,
    RUN_RECORD,
    RunRecord,
    check_tokenizer,
    read_run_record,
)

_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _model_state(chunks, prefix: str, exclude: str | None = None, dp_group=None) -> dict:
    """Sharded state of one model. Tensor keys carry `prefix` ("policy.") so models share a checkpoint.

    `dp_group`: the model's data-parallel group when it was built with process groups of its own
    (rollout/layout.py's layouts); replica ids then come from it instead of parallel_state's groups,
    which belong to the training layout. Its TP group the model's layers already carry."""
    metadata = None if dp_group is None else {"dp_cp_group": dp_group}
    state = {}
    for i, c in enumerate(chunks):
        sd = _unwrap(c).sharded_state_dict(prefix=prefix, metadata=metadata)
        state[f"chunk{i}"] = {k: v for k, v in sd.items() if exclude is None or exclude not in k}
    return state


def _load_into(chunks, model_sd: dict, prefix: str, strict: bool = True) -> None:
    cut = len(prefix)
    for i, chunk in enumerate(chunks):
        _unwrap(chunk).load_state_dict({k[cut:]: v for k, v in model_sd[f"chunk{i}"].items()}, strict=strict)


def _sharded_state(models, optimizers, schedulers, extra, is_loading: bool,
                   optimizer_layout: Optional[dict] = None) -> dict:
    """`optimizer_layout`: how the optimizers' state is laid out (default `optim_state.LAYOUT`, what saves
    write); recorded in the checkpoint's common state, where a load reads it back (`optim_state.saved_layout`)."""
    layout = optimizer_layout or optim_state.LAYOUT
    state: Dict[str, Any] = {"optimizer_layout": dict(layout)}
    if not is_loading:
        state["optimizer_splits"] = {name: optim_state.split(o) for name, o in optimizers.items()}
    for name, chunks in models.items():
        model_sd = _model_state(chunks, f"{name}.")
        state[f"model.{name}"] = model_sd
        if name in optimizers:
            state[f"optimizer.{name}"] = optim_state.sharded_state_dict(optimizers[name], model_sd, name,
                                                                        is_loading, layout)
    for name, sched in schedulers.items():
        state[f"scheduler.{name}"] = sched.state_dict()
    state["extra"] = extra
    return state


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    models: Dict[str, List[torch.nn.Module]],
    optimizers: Dict[str, Any],
    schedulers: Dict[str, Any],
    extra: Dict[str, Any],
    keep_last: int = 2,
    run: Optional[RunRecord] = None,
) -> Path:
    """Write checkpoint `step` atomically on all ranks (collective). Returns the final directory.

    `run`: recorded in the step directory; pruning then removes only this run's older steps. A write that
    fails on any rank (a full disk) removes the partial directory and raises CheckpointError on every rank."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{step_dir_name(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by an earlier crash
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state = _sharded_state(models, optimizers, schedulers, dict(extra, step=step), is_loading=False)
    failure = None
    try:
        with sharding.checked_on_every_rank():
            dist_checkpointing.save(state, str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank{_rank():05d}.pt")
        if run is not None and _rank() == 0:
            record = {"stage": run.stage, "run_id": run.run_id}
            if run.tokenizer is not None:
                record["tokenizer"] = run.tokenizer
            (tmp / RUN_RECORD).write_text(json.dumps(record) + "\n")
    except _load_failures() as e:  # CheckpointException is a BaseException
        failure = e
    _fault_point("after_shards", step)
    _raise_if_any_rank_failed(root, tmp, step, failure)
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
        _prune(root, keep_last, step, run)
    _barrier()
    return final


def _no_space(e: Optional[BaseException]) -> bool:
    """Whether a failed write ran out of disk: ENOSPC anywhere in the chain (DCP wraps it per rank), or the
    torch zip writer's short write ("unexpected pos"), which is what a full disk looks like from inside it."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(x) or "unexpected pos" in str(x):
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return False


def _raise_if_any_rank_failed(root: Path, tmp: Path, step: int, failure: Optional[BaseException]) -> None:
    """Collective: if a rank's write failed, remove the partial `tmp` and raise one CheckpointError on every rank
    (the previous checkpoint and `latest` are untouched)."""
    from megatron_rlhf.checkpoint.damage import root_cause
    from megatron_rlhf.parallel.report import from_every_rank

    mine = None
    if failure is not None:
        mine = ("no space" if _no_space(failure) or _free_bytes(root) < (1 << 20) else root_cause(failure))
    failed = [r for r in from_every_rank(mine) if r is not None]
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial step would fill the disk for every rerun
    _barrier()
    previous = _latest_name(root)
    kept = (f"{root / previous} is intact and a rerun resumes from it" if previous
            else "no earlier checkpoint exists")
    if "no space" in failed:
        raise CheckpointError(f"no space left on {root} while saving step {step}; {kept}: free space there "
                              "or set checkpoint.dir to a larger disk")
    raise CheckpointError(f"saving step {step} to {root} failed ({failed[0]}); {kept}")


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 40  # unknown: do not claim a full disk


def _latest_name(root: Path) -> Optional[str]:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def _fault_point(name: str, step: int) -> None:
    """Test hooks: MEGATRON_RLHF_CRASH_AT=<name>:<step> kills this process there, as kill -9 would;
    MEGATRON_RLHF_STOP_AT=<name>:<step>[:<rank>] sends it SIGTERM there (on that rank only, if given), as a
    preemption at that moment would."""
    import signal

    if os.environ.get("MEGATRON_RLHF_CRASH_AT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MEGATRON_RLHF_STOP_AT") in (f"{name}:{step}", f"{name}:{step}:{_rank()}"):
        os.kill(os.getpid(), signal.SIGTERM)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)


def _prune(root: Path, keep_last: int, step: int, run: Optional[RunRecord]) -> None:
    """Keep `keep_last` checkpoints of this run, the one of `step` (just written) among them: only older
    steps written by the same run are removed, never a higher step or another run's."""
    if keep_last <= 0:
        return
    just_written = step_dir_name(step)
    mine = run.run_id if run is not None else None
    older = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name < just_written
                   and getattr(read_run_record(p), "run_id", None) == mine)
    for old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: str | os.PathLike, resume: bool = True) -> Optional[Path]:
    """The directory `latest` names, None when there is no checkpoint yet; raises if it is broken."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name or not path.is_dir():
        raise CheckpointError(
            f"{pointer} names {name!r}, which is not a checkpoint directory: fix or delete {pointer}"
        )
    if not (path / "metadata.json").exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no metadata.json): point {pointer} at an older step_* directory"
        )
    check_metadata(path, resume)
    return path


def load_checkpoint(
    path: str | os.PathLike,
    models: Dict[str, List[torch.nn.Module]],
    optimizers: Dict[str, Any],
    schedulers: Dict[str, Any],
    load_rng: bool = True,
) -> Dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` into the given objects (collective).

    Models may be built under another layout than the one that saved (Megatron reshards at load).
    Returns `extra` (with `step`).
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    for optimizer in optimizers.values():
        optim_state.allocate(optimizer)
    layout = optim_state.saved_layout(path, optimizers) if optimizers else None
    template = _sharded_state(models, optimizers, schedulers, {}, is_loading=True, optimizer_layout=layout)
    try:
        loaded = dist_checkpointing.load(template, str(path))
    except _load_failures() as e:  # re-raised with the path and a remedy
        if layout and layout["format"] == "dp_reshardable" and "optimizer.distributed." in str(e):
            raise CheckpointError(
                f"checkpoint {path} holds the distributed optimizer's state as each rank's shard, which resumes "
                "only at the parallel.tp and parallel.pp it was saved with (any DP): resume with those, or start a "
                f"new run (another logging.run_dir) from its weights with model.load={path}") from e
        raise CheckpointError(unusable_checkpoint_message(path, e)) from e
    for name, chunks in models.items():
        _load_into(chunks, loaded[f"model.{name}"], f"{name}.")
        if name in optimizers:
            optim_state.load(optimizers[name], loaded[f"optimizer.{name}"])
    for name, sched in schedulers.items():
        sched.load_state_dict(loaded[f"scheduler.{name}"])
    rng = _load_rng(path) if load_rng else None
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return loaded["extra"]


def _load_rng(path: Path) -> Optional[dict]:
    """This rank's RNG states (None if the checkpoint has none); a damaged file fails on every rank."""
    return load_rng_collectively(path / "rng" / f"rank{_rank():05d}.pt", path)


def resolve_checkpoint_dir(path: str | os.PathLike, resume: bool = False) -> Path:
    """A checkpoint root (follows `latest`) or one step directory -> the step directory.

    resume: whether a damage message should suggest resuming from an older step (else model.load)."""
    path = Path(path)
    if (path / LATEST).exists():
        return latest_checkpoint(path, resume)
    if (path / "metadata.json").exists():
        check_metadata(path, resume)
        return path
    raise CheckpointError(
        f"{path} is neither a checkpoint root (with a '{LATEST}' file) nor a checkpoint directory "
        "(with metadata.json): pass the directory a training stage or the converter wrote"
    )


# A model's name in a checkpoint, or names in order of preference (an RM run starts from an SFT policy or goes on
# from a reward model).
Sources = Union[str, Tuple[str, ...]]
# The head each model name carries in training checkpoints.
HEAD_OF = {"policy": "lm", "reference": "lm", "reward": "scalar", "value": "scalar"}
CONVERTED_META = "megatron_rlhf_meta.json"  # written by tools/convert_hf_to_megatron.py


def load_model_weights(path: str | os.PathLike, chunks, source_name: Sources, head: str, skip_head: bool = False,
                       dp_group=None, key: Optional[str] = None, tokenizer: Optional[dict] = None) -> None:
    """Initialise `chunks` (a model with `head` "lm"|"scalar") from a checkpoint, without optimizer state
    (`load_built` with chunks already built; its arguments are this one's)."""
    load_built(path, lambda initialise: chunks, source_name, head, skip_head=skip_head, dp_group=dp_group, key=key,
               tokenizer=tokenizer)


def load_model(path: str | os.PathLike, model_cfg, parallel, source_name: Sources, head: str, *, fp8=None,
               skip_head: bool = False, key: Optional[str] = None, tokenizer: Optional[dict] = None) -> list:
    """`models.build.build_model(model_cfg, parallel, head=head, fp8=fp8)` with its weights from `path`
    (`load_built`, whose arguments the rest are)."""
    from megatron_rlhf.models.build import build_model

    return load_built(path, lambda initialise: build_model(model_cfg, parallel, head=head, fp8=fp8,
                                                            initialise=initialise),
                      source_name, head, skip_head=skip_head, key=key, tokenizer=tokenizer)


def load_built(path: str | os.PathLike, build: Callable[[bool], list], source_name: Sources, head: str, *,
               skip_head: bool = False, dp_group=None, key: Optional[str] = None,
               tokenizer: Optional[dict] = None) -> list:
    """`build(initialise)`'s model chunks (a model with `head` "lm"|"scalar") with weights from a checkpoint,
    without optimizer state. The checkpoint is checked before anything is built, and `initialise` is False
    when it writes every weight the model would draw at random (all but an LM output layer left as built; a
    fresh scalar head starts at zero, drawing nothing).

    `path` is a training checkpoint (root or step directory; the model saved as `source_name` is read, or the
    first one it holds of the names `source_name` gives) or a converted HF checkpoint (its own key prefix and
    head are read from its metadata).
    When the source has another head (a reward model started from an SFT policy or a causal LM),
    the output layer is left as built: a fresh scalar head. Any TP/PP layout loads any checkpoint.
    `skip_head=True` keeps the built (fresh) output layer even when the source has the same head.
    `dp_group`: for a model built in a layout of its own (see `_model_state`), which then loads straight
    into that layout. `key`: the setting `path` came from, named in errors (default: the usual one for
    `source_name`). `tokenizer`: the fingerprint of this run's tokenizer; a checkpoint that records another
    is refused (`check_tokenizer`; None: no check).
    """
    from megatron.core import dist_checkpointing

    key = key or KEY_OF.get(_names(source_name)[0], "model.load")
    step_dir = resolve_checkpoint_dir(path)
    check_tokenizer(step_dir, tokenizer, key)
    prefix, source_head = _source(step_dir, source_name, key)
    skip_head = skip_head or source_head != head
    chunks = build(head != "scalar" and skip_head)  # an LM head left as built is all that is drawn at random
    template = _model_state(chunks, prefix, exclude="output_layer" if skip_head else None, dp_group=dp_group)
    try:
        loaded = dist_checkpointing.load({"m": template}, str(step_dir))
    except _load_failures() as e:
        raise CheckpointError(f"{key}: {unusable_checkpoint_message(step_dir, e, resume=False)}") from e
    _load_into(chunks, loaded["m"], prefix, strict=not skip_head)
    return chunks


def _source(step_dir: Path, source_name: Sources, key: str) -> Tuple[str, str]:
    """(key prefix, head "lm"|"scalar") of the model `source_name` in a training or converted checkpoint: the
    first of the names it gives that the checkpoint holds."""
    if (step_dir / CONVERTED_META).exists():
        try:
            meta = json.loads((step_dir / CONVERTED_META).read_text())
        except ValueError as e:
            raise CheckpointError(f"{key}: {step_dir / CONVERTED_META} is not valid JSON ({e})") from None
        prefix, source_head = meta.get("key_prefix", ""), meta.get("head", "lm")
    else:
        name = _held_source(step_dir, _names(source_name), key)
        prefix, source_head = f"{name}.", HEAD_OF.get(name, "lm")
    return prefix, "scalar" if source_head in ("scalar", "score") else "lm"


def _names(source_name: Sources) -> Tuple[str, ...]:
    return (source_name,) if isinstance(source_name, str) else tuple(source_name)


KEY_OF = {"policy": "model.load", "reward": "ppo.reward_load", "value": "ppo.value_load"}  # where each comes from
_WHAT = {"policy": "a policy (LM head)", "reference": "a reference policy (LM head)",
         "reward": "a reward model (scalar head)", "value": "a value model (scalar head)"}
_FROM = {"policy": "an SFT (or PPO/DPO) checkpoint or a converted HF model",
         "reward": "a reward-model checkpoint (stage 2 output)", "value": "a PPO checkpoint (its value model)"}


def _held_source(step_dir: Path, wanted: Tuple[str, ...], key: str) -> str:
    """The first of `wanted` that the checkpoint holds; else one line naming `key`, what it holds and what it
    should point at (not "damaged": the files are fine, the setting points at another kind)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        names = {k.split(".")[0] for k in FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata}
    except Exception:  # noqa: BLE001 - unreadable metadata is reported as damage by the load itself
        return wanted[0]
    found = next((n for n in wanted if n in names), None)
    held = sorted(n for n in names if n in _WHAT)
    if found is not None or not held:
        return found or wanted[0]
    raise CheckpointError(
        f"{key}: {step_dir} holds {' and '.join(_WHAT[n] for n in held)}, not "
        f"{' or '.join(_WHAT.get(n, n) for n in wanted)}: point {key} at "
        f"{' or '.join(_FROM.get(n, 'a checkpoint holding one') for n in wanted)}")
