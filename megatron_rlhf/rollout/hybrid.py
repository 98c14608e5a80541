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

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_rlhf.parallel.device import compute_device
from megatron_rlhf.rollout.base import RolloutEngine, SamplingParams
from megatron_rlhf.rollout.layout import build_in_layout, generate_in_layout, same_layout, tp_only_layout
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

PLAN_ATTR = "_cached_reshard_plan"  # where megatron-core 0.16.1's reshard_model_weights keeps its plan
PLAN_KEY_ATTR = "_megatron_rlhf_plan_key"  # what that plan was built for (ours)


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
                                  or getattr(self.target, PLAN_ATTR, None) is None)], device=compute_device())
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


class HybridRolloutEngine(RolloutEngine):
    """Generation in a tp-only layout with a resharded copy of the policy (module docstring)."""

    shares_policy_weights = False

    def __init__(self, train_chunks: Sequence[torch.nn.Module], model_cfg, train_tp: int, tp: int, *,
                 eos_id: Union[None, int, Sequence[int]], pad_id: int, vocab_size: int,
                 release_device: Optional[str] = "auto"):
        """release_device: where the training weights are released from during decoding (offload.released:
        "auto" = CUDA if present; None keeps them; "cpu" runs the moves on CPU, for tests)."""
        self.train_chunks, self.release_device = list(train_chunks), release_device
        self.layout = tp_only_layout(tp)
        # Drawing nothing: the first generate swaps every element in (`_copy_due` is true on a first call).
        self.model = build_in_layout(model_cfg, train_tp, self.layout, initialise=False)
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


def make_rollout_engine(cfg, model_cfg, train_chunks: List[torch.nn.Module], tokenizer) -> RolloutEngine:
    """The PPO stage's engine for `rollout.engine` and `rollout.tp` (collective when it builds a layout)."""
    from megatron_rlhf.config.rollout import generation_tp

    from megatron_rlhf.data.tokenizer import stop_ids

    kw = dict(eos_id=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id, vocab_size=model_cfg.vocab_size)
    tp = generation_tp(cfg)
    release = "auto" if cfg.rollout.release_training_weights else None
    if cfg.rollout.engine == "vllm":
        from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(train_chunks, model_cfg, tp, cfg.logging.run_dir, eos_id=kw["eos_id"],
                                 pad_id=kw["pad_id"], seed=cfg.train.seed, settings=cfg.rollout.vllm,
                                 release_device=release)
    if same_layout(cfg.parallel, tp):
        return MegatronRolloutEngine(train_chunks, **kw)
    return HybridRolloutEngine(train_chunks, model_cfg, cfg.parallel.tp, tp, **kw, release_device=release)


