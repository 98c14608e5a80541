"""Hybrid engine: the policy generates in a layout of its own, apart from the training layout.

    training layout      any TP x PP (x VPP) x DP the policy trains in (Megatron's parallel state)
    generation layout    TP = rollout.tp, PP = 1, DP = world / rollout.tp, with its own process
                         groups (a Megatron `ProcessGroupCollection`)

Before each `generate`, the trained weights move into a generation copy of the policy with
`megatron.core.resharding.swap_model_weights` (gloo on CPU, NCCL on GPU). When the two layouts are
equal, `make_rollout_engine` returns the plain `MegatronRolloutEngine` on the training parameters:
no copy, no second model.

Two traps of megatron-core 0.16.1's resharding are handled here:
- `reshard_model_weights` keeps only the first element of a list of model chunks, so a VPP rank's
  chunks are presented as ONE module (`ChunksAsOne`) whose parameter names are already global
  (layer indices resolved with `hf_mapping.global_name`; chunk-local names would collide).
- it caches its plan on the target model (`_cached_reshard_plan`) and never checks it again. A plan
  built for other layouts silently copies the wrong slices, so `WeightSwap` keys the plan by both
  layouts (names, shapes, TP attributes and process-group ranks on both sides) and drops it when the
  key changes; the decision is all-reduced, because building a plan is collective.

Memory: once the copy holds the weights, the training weights themselves wait in host memory while
the copy decodes (`rollout.release_training_weights`, rollout/offload.py's `released`; GPU only).

Data: `generate` takes this rank's training share of prompts (as the RolloutEngine contract says)
and returns the responses to exactly those prompts; in between, the global batch is decoded split
over generation DP ranks (rollout/redistribute.py: no duplicate, no loss, training DP order).
Sampling draws (`uniforms`) travel with their rows, so tokens do not depend on either split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rlhf.rollout import redistribute as R
from megatron_rlhf.rollout.base import RolloutEngine, SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

PLAN_ATTR = "_cached_reshard_plan"  # where megatron-core 0.16.1's reshard_model_weights keeps its plan
PLAN_KEY_ATTR = "_megatron_rlhf_plan_key"  # what that plan was built for (ours)


@dataclass
class Layout:
    """A tp-only layout over the whole world. Rank r is TP rank r % tp of DP rank r // tp (TP innermost,
    as in Megatron's default order, so a TP group is a block of consecutive ranks)."""

    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection


def tp_only_layout(tp: int) -> Layout:
    """Collective (all ranks, same order): process groups of TP=tp, PP=1, CP=1, DP=world/tp.

    The enumeration `HyperCommGrid([tp, 1, dp, 1], ["tp", "cp", "dp", "pp"])` would make, written out
    (the grid needs einops, which nothing else here does)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"generation tp={tp} does not divide the world size {world}")
    dp = world // tp

    def groups(enumeration):
        return dist.new_subgroups_by_enumeration(enumeration)[0]

    singletons = [[r] for r in range(world)]
    pgs = ProcessGroupCollection(
        tp=groups([[d * tp + t for t in range(tp)] for d in range(dp)]),
        dp=groups([[d * tp + t for d in range(dp)] for t in range(tp)]),
        cp=groups(singletons), pp=groups(singletons))
    pgs.embd = pgs.pp  # PP=1: the one stage holds both ends of a tied embedding
    pgs.pos_embd = pgs.pp
    return Layout(tp, dp, rank % tp, rank // tp, pgs)


def build_in_layout(model_cfg, train_tp: int, layout: Layout, head: str = "lm") -> torch.nn.Module:
    """A GPTModel for `layout` (random weights: a swap or a load replaces them).

    The vocabulary keeps the padding of the training TP (`model_cfg.padded_vocab_size(train_tp)`), so
    every vocab-parallel tensor has the same global shape in both layouts (rollout_config checks that
    `layout.tp` divides it)."""
    from megatron_rlhf.models.build import build_model_chunk
    from megatron_rlhf.models.spec import transformer_config
    from megatron_rlhf.parallel.layout import ParallelConfig

    padded = model_cfg.padded_vocab_size(train_tp)
    same_padding = dataclasses.replace(model_cfg, make_vocab_size_divisible_by=padded // layout.tp)
    parallel = ParallelConfig(tp=layout.tp)
    config = transformer_config(same_padding, parallel, None)
    # Initialised anyway (perform_initialization=False would also skip the TP attributes that the
    # resharding planner reads), but under a forked RNG: building it must not move training's draws.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        model = build_model_chunk(same_padding, parallel, head=head, config=config,
                                  pg_collection=layout.pg_collection)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model.eval()


class ChunksAsOne(torch.nn.Module):
    """One rank's training chunks (VPP: several) seen as one module with global parameter names.

    Only what megatron-core's resharding reads: `named_parameters`, `named_modules` (no layer
    prefixes to resolve: names are global already), `config` and `pg_collection`."""

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        from megatron.core.utils import unwrap_model

        super().__init__()
        cores = [unwrap_model(c) for c in chunks]
        object.__setattr__(self, "_cores", cores)  # not submodules: their local names collide
        self.config = cores[0].config
        self.pg_collection = cores[0].pg_collection

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        from megatron_rlhf.models.hf_mapping import global_name

        for core in self._cores:
            for name, p in core.named_parameters():
                yield global_name(core, name), p

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        yield prefix, self


def _group_ranks(pgs, name: str):
    group = getattr(pgs, name, None)
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def layout_key(module: torch.nn.Module) -> tuple:
    """Everything a reshard plan depends on, on this rank: parameter names, shapes, dtypes, TP split
    attributes, and the ranks of the module's TP / PP / DP groups."""
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), bool(getattr(p, "tensor_model_parallel", False)),
         int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1)))
        for n, p in module.named_parameters()
    )
    return params, tuple(_group_ranks(module.pg_collection, g) for g in ("tp", "pp", "dp"))


class WeightSwap:
    """Copy the policy's training chunks into a model of another layout (collective, all ranks)."""

    def __init__(self, train_chunks: Sequence[torch.nn.Module], target: torch.nn.Module, transport: str = "auto"):
        """transport (CPU): "auto" = shared memory when every rank is on one host and /dev/shm has room,
        else gloo P2P; "gloo" = gloo P2P always (what several hosts get; tests use it to run that path)."""
        from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
        from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService
        from megatron.core.utils import unwrap_model

        self.source = ChunksAsOne(train_chunks)
        self.target = unwrap_model(target)
        if getattr(self.source.pg_collection, "dp", None) is None:  # resharding needs the source DP group
            from megatron.core import parallel_state as ps

            self.source.pg_collection.dp = ps.get_data_parallel_group()
        # Our own service instance (not resharding's module-level cache, which would outlive a
        # destroyed process group).
        self.service = NCCLCopyService() if torch.cuda.is_available() else GlooCopyService()
        self.plans_built = 0  # for tests and logs
        # CPU: the shared-memory transport of the cached plan (rollout/shm_exchange.py; None: gloo P2P).
        self.exchange, self.exchange_plan = None, None
        if transport not in ("auto", "gloo"):
            raise ValueError(f"WeightSwap transport={transport!r}: use 'auto' or 'gloo'")
        self.transport = transport

    @torch.no_grad()
    def __call__(self) -> None:
        """What megatron's `swap_model_weights` does (plan cached on the target, then executed), with the
        plan keyed by both layouts, and on CPU our one-copy executor (rollout/reshard_exec.py)."""
        from megatron.core.resharding import build_centralized_reshard_plan, execute_reshard_plan

        from megatron_rlhf.rollout.reshard_exec import execute_plan_gloo

        key = (layout_key(self.source), layout_key(self.target))
        stale = torch.tensor([int(getattr(self.target, PLAN_KEY_ATTR, None) != key
                                  or getattr(self.target, PLAN_ATTR, None) is None)], device=_device())
        dist.all_reduce(stale, op=dist.ReduceOp.MAX)  # building a plan is collective: all ranks or none
        if stale.item():
            plan = build_centralized_reshard_plan(self.source, self.target,
                                                  num_experts=self.source.config.num_moe_experts)
            setattr(self.target, PLAN_ATTR, plan)
            setattr(self.target, PLAN_KEY_ATTR, key)
            self.plans_built += 1
        plan = getattr(self.target, PLAN_ATTR)
        if torch.cuda.is_available():
            execute_reshard_plan(plan, self.source, self.target, service=self.service)
            return
        if self.transport == "auto" and self.exchange_plan is not plan:  # a new plan on all ranks (stale is all-reduced)
            from megatron_rlhf.rollout.shm_exchange import SharedMemoryExchange

            self.exchange = SharedMemoryExchange.build(plan, self.source, self.target, self.service.gloo_pg)
            self.exchange_plan = plan
        execute_plan_gloo(plan, self.source, self.target, self.service.gloo_pg, exchange=self.exchange)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def training_share_index() -> tuple[int, bool]:
    """(training DP rank, whether this rank represents its share: TP, PP and CP rank 0)."""
    from megatron.core import parallel_state as ps

    rep = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
           and ps.get_context_parallel_rank() == 0)
    return ps.get_data_parallel_rank(), rep


def run_in_layout(layout: Layout, mine: Dict[str, torch.Tensor], concat: Callable, fn: Callable) -> Dict[str, torch.Tensor]:
    """The rows of all training shares, processed split over `layout`'s DP ranks; this share's results back.

    mine: this rank's training-share rows (every tensor [n, ...]); concat(list of shares) -> the global batch
    in training DP order; fn(rows of the global batch) -> dict of [rows, ...] results, identical on the TP
    ranks of a `layout` group (only TP rank 0's are gathered). Collective over the world."""
    index, rep = training_share_index()
    shares = R.gather_shares(mine if rep else None, index)
    batch = concat(shares)
    total = _rows_in(batch)
    rows, _ = R.part_rows(total, layout.dp, layout.dp_rank)
    out = fn(R.take(batch, rows))
    parts = R.gather_shares(out if layout.tp_rank == 0 else None, layout.dp_rank)
    reals = [R.part_rows(total, layout.dp, g)[1] for g in range(layout.dp)]
    everything = R.concat_parts(parts, reals)
    sizes = [_rows_in(s) for s in shares]
    return {k: v[R.share_bounds(sizes, index)] for k, v in everything.items()}


def _rows_in(rows: Dict[str, torch.Tensor]) -> int:
    return next(iter(rows.values())).shape[0]


def generate_in_layout(layout: Layout, decode: Callable, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       uniforms: Optional[torch.Tensor], pad_id: int) -> Dict[str, torch.Tensor]:
    """Training shares of prompts in, the responses to them out; decoded split over `layout`'s DP ranks.

    decode(input_ids [n, s], attention_mask [n, s], uniforms [n, T] | None) -> base.py's dict for those rows,
    identical on the TP ranks of a `layout` group (the sampler broadcasts TP rank 0's tokens)."""
    mine = {"input_ids": prompt_ids, "attention_mask": prompt_mask.bool()}
    if uniforms is not None:
        mine["uniforms"] = uniforms
    out = run_in_layout(layout, mine, lambda shares: R.concat_prompts(shares, pad_id),
                        lambda part: decode(part["input_ids"], part["attention_mask"], part.get("uniforms")))
    return {k: v.to(prompt_ids.device) for k, v in out.items()}


class HybridRolloutEngine(RolloutEngine):
    """Generation in a tp-only layout with a resharded copy of the policy (module docstring)."""

    shares_policy_weights = False

    def __init__(self, train_chunks: Sequence[torch.nn.Module], model_cfg, train_tp: int, tp: int, *,
                 eos_id: Optional[int], pad_id: int, vocab_size: int, release_device: Optional[str] = "auto"):
        """release_device: where the training weights are released from during decoding (offload.released:
        "auto" = CUDA if present; None keeps them; "cpu" runs the moves on CPU, for tests)."""
        self.train_chunks, self.release_device = list(train_chunks), release_device
        self.layout = tp_only_layout(tp)
        self.model = build_in_layout(model_cfg, train_tp, self.layout)
        self.swap = WeightSwap(train_chunks, self.model)
        self.decoder = MegatronRolloutEngine(self.model, eos_id=eos_id, pad_id=pad_id, vocab_size=vocab_size)
        self.pad_id = pad_id

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams, generator=None, uniforms=None):
        """This rank's training share of prompts [b, s] -> responses to them (base.py's dict, [b, T])."""
        from megatron_rlhf.rollout.offload import released

        if self._copy_due():  # the weights of the latest optimizer step
            self.swap()

        def decode(ids, mask, draws):  # the sampler on the copy
            return self.decoder.generate(ids, mask, sampling, generator=generator, uniforms=draws)

        with released(self.train_chunks, self.release_device):  # the copy decodes; training's weights wait
            return generate_in_layout(self.layout, decode, prompt_ids, prompt_mask, uniforms, self.pad_id)

    def update_weights(self, named_tensors) -> None:
        raise NotImplementedError("the hybrid engine pulls the policy's weights itself before each generate "
                                  "(WeightSwap); there is nothing to push")


def same_layout(parallel, tp: int) -> bool:
    """Does the training layout generate as it is (TP = tp and nothing else split)?"""
    return parallel.tp == tp and parallel.pp == 1 and not parallel.vpp and parallel.cp == 1 \
        and not parallel.sequence_parallel


def make_rollout_engine(cfg, model_cfg, train_chunks: List[torch.nn.Module], tokenizer) -> RolloutEngine:
    """The PPO stage's engine for `rollout.engine` and `rollout.tp` (collective when it builds a layout)."""
    from megatron_rlhf.rollout_config import generation_tp

    kw = dict(eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, vocab_size=model_cfg.vocab_size)
    tp = generation_tp(cfg)
    release = "auto" if cfg.rollout.release_training_weights else None
    if cfg.rollout.engine == "vllm":
        import os

        from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(train_chunks, model_cfg, tp, os.path.join(cfg.logging.run_dir, "vllm_config"),
                                 eos_id=kw["eos_id"], pad_id=kw["pad_id"], bucket_mb=cfg.rollout.bucket_mb,
                                 seed=cfg.train.seed, release_device=release)
    if same_layout(cfg.parallel, tp):
        return MegatronRolloutEngine(train_chunks, **kw)
    return HybridRolloutEngine(train_chunks, model_cfg, cfg.parallel.tp, tp, **kw, release_device=release)


