"""A Megatron optimizer's state in a checkpoint: its sharded state dict, and loading it when the inner
optimizer is torch's Adam(W).

Layout (`LAYOUT`, recorded in each checkpoint): a distributed optimizer's state is written as each rank's
own shard of Megatron's buckets ("dp_reshardable", Megatron's default: nothing is gathered, and it resumes at
any DP with the same TP and PP). "fully_reshardable", the format of earlier checkpoints (still read),
gathers the whole state into host memory on every rank at each save: PPO on SmolLM2-135M at DP=2 reached
12 GB per rank and was killed; an 8B policy would need ~100 GB. Megatron keys that shard
"optimizer.distributed.dp_group_idx_<i>.*" whichever model the optimizer steps, so two optimizers in one
checkpoint (PPO's policy and value) wrote the same keys: Megatron's sharding validation then failed on rank 0
alone and the other ranks waited in the save until the watchdog. Keys "by_model" put the model's name in
front of every key of its optimizer; "shared" (earlier checkpoints, one optimizer each) did not.

Each checkpoint also records each optimizer's `split` (distributed or not, and the TP, PP and virtual stages its
shards follow), so that a resume that cannot read the state (the distributed optimizer switched on or off, or
its shards at another TP or PP) stops before loading, in one line naming the setting (`resume_problem`).

Megatron-Core 0.16.1 loads its DistributedOptimizer's state fully only for Transformer Engine's and
Apex's fused Adams, which keep `step` per parameter group. torch's Adam keeps a `step` tensor per
parameter, and two places then fail (each hit by a resumed run; neither needs a GPU to fail):
- building the loading template calls `DistributedOptimizer.state_dict`, which asserts one common
  `step` over the inner optimizer's state, and a fresh torch Adam has no state yet (`allocate`);
- `load_state_dict` puts the checkpoint's step into every parameter's state, then copies each loaded
  parameter's tensors into that state key by key; the loaded tensors never carry `step` (Megatron
  keeps it apart), so the copy stops at a KeyError (`load`). And that step is one tensor put into every
  parameter's state: torch's Adam adds 1 to each parameter's step in place, so the shared one would
  advance by the number of parameters per optimizer step and spoil the bias correction (`load` gives
  each parameter its own copy).
`load` also keeps the run's Adam kernel (trainer/optim.py `use_fused_adam`): `load_state_dict` takes
the checkpoint's param groups whole, and a checkpoint written with the foreach kernel must not switch
this run off the fused one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

KERNEL_KEYS = ("fused", "foreach")
LAYOUT = {"format": "dp_reshardable", "keys": "by_model"}  # what saves write
EARLIER_FORMAT = "fully_reshardable"  # a checkpoint that records no format


def sharded_state_dict(optimizer, model_sd: dict, name: str, is_loading: bool, layout: dict) -> dict:
    """`optimizer`'s sharded state dict in `layout` (see the module's docstring), for the model `name`
    whose sharded state dict is `model_sd`."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    fmt = layout["format"]
    with step_apart(optimizer) if fmt == "dp_reshardable" else contextlib.nullcontext():
        sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                          metadata={"distrib_optim_sharding_type": fmt})
    if layout["keys"] == "by_model":
        add_prefix_for_sharding(sd, f"{name}.")
    return sd


SPLIT_SETTINGS = {"distributed": "use_distributed_optimizer", "tp": "tp", "pp": "pp", "vpp": "vpp"}


def split(optimizer) -> dict:
    """What a resume must match to read `optimizer`'s saved state: {"distributed": bool, "tp", "pp", "vpp"}
    (the model split of this rank, which a distributed optimizer's per-rank shards follow)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return {"distributed": any(isinstance(o, DistributedOptimizer) for o in _inner(optimizer)),
            "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size()}


def resume_problem(saved: dict, current: dict, layout: dict) -> Optional[Tuple[str, str]]:
    """(what differs, the settings that resume it) when optimizer state saved under the split `saved` cannot
    load into an optimizer under `current` (`split`); None when it can. A plain optimizer's state reshards to
    any split; a distributed one's only to another DP in "dp_reshardable"; neither reads the other's."""
    def setting(key: str, value) -> str:  # as an override is written
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        return f"parallel.{SPLIT_SETTINGS[key]}={shown}"

    if saved["distributed"] != current["distributed"]:
        return (f"it was saved with {setting('distributed', saved['distributed'])} and this run sets "
                f"{str(current['distributed']).lower()}", setting("distributed", saved["distributed"]))
    changed = [k for k in ("tp", "pp", "vpp") if saved.get(k) != current[k]]
    if saved["distributed"] and layout["format"] == "dp_reshardable" and changed:
        this_run = ", ".join(setting(k, current[k]) for k in changed)
        return ("its distributed optimizer state is each rank's shard, which resumes only at the parallel.tp and "
                f"parallel.pp it was saved with (any DP; this run has {this_run})",
                ", ".join(setting(k, saved.get(k)) for k in changed))
    return None


def saved_layout(path: Path, optimizers: Dict[str, Any]) -> dict:
    """How a checkpoint lays out its optimizers' state (`LAYOUT`), from its common state, once each
    of `optimizers` is known to read it: if one cannot (`resume_problem`), CheckpointError naming the
    setting. A checkpoint that records no layout: Megatron's own record of its distributed optimizer's format
    (default the earlier "fully_reshardable"), keys shared between models. Unreadable: the load itself reports
    the damage."""
    from megatron.core import dist_checkpointing

    from megatron_rlhf.checkpoint.damage import CheckpointError

    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception:  # noqa: BLE001 - reported by the load that follows, with the path and a remedy
        return dict(LAYOUT)
    if isinstance(common.get("optimizer_layout"), dict):
        layout = common["optimizer_layout"]
        splits = common.get("optimizer_splits") or {}
        for name, saved in splits.items():
            problem = resume_problem(saved, split(optimizers[name]), layout) if name in optimizers else None
            if problem:
                raise CheckpointError(f"checkpoint {path} cannot resume this run's {name} optimizer: {problem[0]}: "
                                      f"resume with {problem[1]}, or {_new_run_from(path, splits)}")
        return layout
    todo = [common]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("param_state_sharding_type"), str):
                return {"format": node["param_state_sharding_type"], "keys": "shared"}
            todo += list(node.values())
        elif isinstance(node, (list, tuple)):
            todo += list(node)
    return {"format": EARLIER_FORMAT, "keys": "shared"}


def _new_run_from(path: Path, models) -> str:
    """How a new run starts from the weights of a checkpoint holding `models` (names), without its optimizers.
    PPO's and DPO's need their reference named: without it, it would be this policy (model.load)."""
    from megatron_rlhf.checkpoint.record import read_run_record

    start = f"start a new run (another logging.run_dir) from its weights with model.load={path}"
    if "value" in models:  # PPO
        return f"{start} ppo.value_load={path} ppo.reference_load=<the SFT checkpoint it started from>"
    record = read_run_record(path)
    if record is not None and record.stage == "dpo":
        return f"{start} dpo.reference_load=<the SFT checkpoint it started from>"
    return start


def _inner(optimizer) -> list:
    """The Megatron optimizers inside a (possibly chained) one."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_optimizers(optimizer) -> list:
    return [getattr(o, "optimizer", None) for o in _inner(optimizer)]


def _distributed_adams(optimizer):
    """(DistributedOptimizer, its torch Adam) pairs; Adam covers AdamW, its subclass."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner, torch_opt in zip(_inner(optimizer), _torch_optimizers(optimizer)):
        if isinstance(inner, DistributedOptimizer) and isinstance(torch_opt, torch.optim.Adam):
            yield inner, torch_opt


def allocate(optimizer) -> None:
    """Give a fresh torch Adam inside a DistributedOptimizer the state its first step would make (step 0,
    zero moments), so that the loading template can be built; the checkpoint then overwrites it."""
    for _, torch_opt in _distributed_adams(optimizer):
        for group in torch_opt.param_groups:
            on_device = group.get("fused") or group.get("capturable")  # where torch's Adam keeps `step`
            for p in group["params"]:
                if not torch_opt.state[p]:
                    torch_opt.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


@contextlib.contextmanager
def step_apart(optimizer):
    """While a DistributedOptimizer builds its "dp_reshardable" state dict (each rank's shard of its buckets):
    each parameter's tensors without torch Adam's per-parameter `step`. That format shards every tensor it is
    given like a moment, so the 0-dim step went to disk as a slice of a bucket and came back as garbage (a
    resumed run's bias correction then differed). The step travels in the param groups instead
    (`DistributedOptimizer.state_dict`), and `load` gives it back to every parameter."""
    with contextlib.ExitStack() as stack:
        for dist_opt, _ in _distributed_adams(optimizer):
            stack.enter_context(_without_step(dist_opt))
        yield


@contextlib.contextmanager
def _without_step(dist_opt):
    original = dist_opt._get_main_param_and_optimizer_states

    def get_states(model_param):
        return {k: v for k, v in original(model_param).items() if k != "step"}

    dist_opt._get_main_param_and_optimizer_states = get_states
    try:
        yield
    finally:
        del dist_opt._get_main_param_and_optimizer_states  # the class's method again


def load(optimizer, state_dict) -> None:
    """`optimizer.load_state_dict(state_dict)`, with the step kept apart from the per-parameter copy and
    the run's Adam kernel flags kept. Under no_grad: Megatron's "dp_reshardable" load copies into an fp32
    model's main parameters, which are views of the model's (leaf, requires-grad) parameters, without it."""
    kernels = kernel_flags(optimizer)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for dist_opt, torch_opt in _distributed_adams(optimizer):
            stack.enter_context(_step_kept(dist_opt, torch_opt))
        optimizer.load_state_dict(state_dict)
    for _, torch_opt in _distributed_adams(optimizer):
        for state in torch_opt.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
    set_kernel_flags(optimizer, kernels)


@contextlib.contextmanager
def _step_kept(dist_opt, torch_opt):
    """While loading, this instance's per-parameter copy leaves `step` as `load_state_dict` set it."""
    original = dist_opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = dist_opt.model_param_group_index_map[model_param]
        step = torch_opt.state[torch_opt.param_groups[group_index]["params"][group_order]].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}  # copied onto itself
        original(model_param, tensors)

    dist_opt._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        del dist_opt._set_main_param_and_optimizer_states  # the class's method again


def kernel_flags(optimizer) -> list:
    """Each inner torch optimizer's per-group kernel choice."""
    return [[{k: g.get(k) for k in KERNEL_KEYS} for g in o.param_groups] if o is not None else None
            for o in _torch_optimizers(optimizer)]


def set_kernel_flags(optimizer, flags: list) -> None:
    """Put a kernel choice taken by `kernel_flags` back."""
    for o, groups in zip(_torch_optimizers(optimizer), flags):
        if o is not None and groups is not None and len(groups) == len(o.param_groups):
            for g, kept in zip(o.param_groups, groups):
                g.update(kept)
