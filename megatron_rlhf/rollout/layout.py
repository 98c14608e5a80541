"""The generation layout: TP = tp, PP = 1, DP = world / tp over the whole world, as data and process groups.

A frozen model or a generation copy of the policy is built in such a layout (`build_in_layout`), and work
on the rows of all training shares runs split over its DP ranks (`run_in_layout`, `generate_in_layout`):
each rank hands in its training share of rows and gets back the results for exactly those rows
(rollout/redistribute.py: no duplicate, no loss, training DP order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron_rlhf.rollout import redistribute as R


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


def build_in_layout(model_cfg, train_tp: int, layout: Layout, head: str = "lm",
                    initialise: bool = True) -> torch.nn.Module:
    """A GPTModel for `layout`, whose weights a swap or a load then replaces.

    `initialise=False`: that swap or load writes every element, so none is drawn first (`models.build.
    initialisation`: the weights hold whatever memory held; the tensor-parallel attributes that the
    resharding planner reads are set all the same). The vocabulary keeps the padding of the training TP
    (`model_cfg.padded_vocab_size(train_tp)`), so every vocab-parallel tensor has the same global shape in
    both layouts (config/rollout.py checks that `layout.tp` divides it)."""
    from megatron_rlhf.models.build import build_model_chunk, initialisation
    from megatron_rlhf.models.spec import transformer_config
    from megatron_rlhf.parallel.layout import ParallelConfig

    padded = model_cfg.padded_vocab_size(train_tp)
    same_padding = dataclasses.replace(model_cfg, make_vocab_size_divisible_by=padded // layout.tp)
    parallel = ParallelConfig(tp=layout.tp)
    config = transformer_config(same_padding, parallel, None, **initialisation(initialise))
    # Under a forked RNG: building a model that draws its weights must not move training's draws.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        model = build_model_chunk(same_padding, parallel, head=head, config=config,
                                  pg_collection=layout.pg_collection)
    return model.eval()


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


def same_layout(parallel, tp: int) -> bool:
    """Does the training layout generate as it is (TP = tp and nothing else split)?"""
    return parallel.tp == tp and parallel.pp == 1 and not parallel.vpp and parallel.cp == 1 \
        and not parallel.sequence_parallel
