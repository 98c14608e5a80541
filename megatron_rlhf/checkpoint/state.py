"""Distributed, atomic, resumable training checkpoints.

Layout under the checkpoint root:

    step_00000040/            one complete checkpoint (Megatron `torch_dist` + per-rank RNG files)
        rng/rank00000.pt      torch CPU (and CUDA) generator states of each rank
        ...
    latest                    text file naming the newest complete checkpoint; written last

A checkpoint is written into `.tmp-step_XXXXXXXX`, renamed when every rank has finished, and
only then does `latest` move (atomic `os.replace`). A crash at any point leaves the previous
checkpoint valid and `latest` pointing to it. The last `keep_last` checkpoints are kept.

What is saved: each named model (all its chunks), each named optimizer (fully reshardable, so a
run may resume under another layout) and scheduler, plus `extra`: any picklable state that is
the same on every rank (step, data cursor, KL controller, ...). RNG states are per rank.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from megatron_rlhf.checkpoint.damage import (  # noqa: F401 - CheckpointError is imported from here
    CheckpointError,
    _load_failures,
    check_metadata,
    load_rng_collectively,
    unusable_checkpoint_message,
)

LATEST = "latest"
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
    (rollout/hybrid.py's layouts); replica ids then come from it instead of parallel_state's groups,
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


_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(models, optimizers, schedulers, extra, is_loading: bool) -> dict:
    state: Dict[str, Any] = {}
    for name, chunks in models.items():
        model_sd = _model_state(chunks, f"{name}.")
        state[f"model.{name}"] = model_sd
        if name in optimizers:
            state[f"optimizer.{name}"] = optimizers[name].sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=_OPT_METADATA
            )
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
) -> Path:
    """Write checkpoint `step` atomically on all ranks (collective). Returns the final directory."""
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
    dist_checkpointing.save(state, str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{_rank():05d}.pt")
    _fault_point("after_shards", step)
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
        _prune(root, keep_last)
    _barrier()
    return final


def _fault_point(name: str, step: int) -> None:
    """Test hook: MEGATRON_RLHF_CRASH_AT=<name>:<step> kills this process there, as kill -9 would."""
    if os.environ.get("MEGATRON_RLHF_CRASH_AT") == f"{name}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))
    for old in done[:-keep_last]:
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
    template = _sharded_state(models, optimizers, schedulers, {}, is_loading=True)
    try:
        loaded = dist_checkpointing.load(template, str(path))
    except _load_failures() as e:  # re-raised with the path and a remedy
        raise CheckpointError(unusable_checkpoint_message(path, e)) from e
    for name, chunks in models.items():
        _load_into(chunks, loaded[f"model.{name}"], f"{name}.")
        if name in optimizers:
            optimizers[name].load_state_dict(loaded[f"optimizer.{name}"])
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


# The head each model name carries in training checkpoints.
HEAD_OF = {"policy": "lm", "reference": "lm", "reward": "scalar", "value": "scalar"}
CONVERTED_META = "megatron_rlhf_meta.json"  # written by tools/convert_hf_to_megatron.py


def load_model_weights(path: str | os.PathLike, chunks, source_name: str, head: str, skip_head: bool = False,
                       dp_group=None) -> None:
    """Initialise `chunks` (a model with `head` "lm"|"scalar") from a checkpoint, without optimizer state.

    `path` is a training checkpoint (root or step directory; the model saved as `source_name` is
    read) or a converted HF checkpoint (its own key prefix and head are read from its metadata).
    When the source has another head (a reward model started from an SFT policy or a causal LM),
    the output layer is left as built: a fresh scalar head. Any TP/PP layout loads any checkpoint.
    `skip_head=True` keeps the built (fresh) output layer even when the source has the same head.
    `dp_group`: for a model built in a layout of its own (see `_model_state`), which then loads straight
    into that layout.
    """
    import json

    from megatron.core import dist_checkpointing

    step_dir = resolve_checkpoint_dir(path)
    if (step_dir / CONVERTED_META).exists():
        try:
            meta = json.loads((step_dir / CONVERTED_META).read_text())
        except ValueError as e:
            raise CheckpointError(f"model.load: {step_dir / CONVERTED_META} is not valid JSON ({e})") from None
        prefix, source_head = meta.get("key_prefix", ""), meta.get("head", "lm")
    else:
        prefix, source_head = f"{source_name}.", HEAD_OF.get(source_name, "lm")
    skip_head = skip_head or ("scalar" if source_head in ("scalar", "score") else "lm") != head
    template = _model_state(chunks, prefix, exclude="output_layer" if skip_head else None, dp_group=dp_group)
    try:
        loaded = dist_checkpointing.load({"m": template}, str(step_dir))
    except _load_failures() as e:
        raise CheckpointError(f"model.load: {unusable_checkpoint_message(step_dir, e, resume=False)}") from e
    _load_into(chunks, loaded["m"], prefix, strict=not skip_head)
