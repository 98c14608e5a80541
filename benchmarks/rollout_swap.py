"""The 2-rank part of benchmarks/rollout.py: weight swap training TP=2 -> generation TP=1, against a plain copy.

    torchrun --nproc_per_node 2 benchmarks/rollout_swap.py OUT.json [--hidden 512] [--repeats 5] [--threads 1]

(`python benchmarks/rollout.py` starts it itself.) Both ranks build the policy at training TP=2 and a
generation copy at TP=1 x DP=2 (rollout/hybrid.py: `tp_only_layout`, `build_in_layout`, `WeightSwap`, as
the PPO stage does). One swap warms up (it builds the reshard plan, done once per run in PPO) and is
checked: the copy must then hold the training weights (the TP=2 halves gathered). Then `repeats` rounds,
each timing one swap (the slower rank's wall time: the swap is collective) and one plain copy of the same
bytes on each rank (`dst.copy_(src)` of flat buffers as large as the generation copy's parameters). The
swap moves `bytes` per rank: every generation rank receives the whole model, half of each TP-split
tensor from the other rank over gloo (loopback TCP on CPU).

    swap_ratio_vs_memcpy = (bytes / median swap time) / (bytes / median copy time)

Each round also runs the same cached plan through megatron-core's own executor and gloo service
(`swap_speedup_vs_megatron_executor`: on CPU WeightSwap uses rollout/reshard_exec.py instead).

Rank 0 writes the figures to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_rlhf.models.spec import ModelConfig  # noqa: E402

PAD_VOCAB_TO = 128  # vocab 512 padded alike at TP=1 and TP=2


def model_config(hidden: int) -> ModelConfig:
    """The rollout benchmark's Llama shape (4 layers, 4 heads, 2 query groups) at `hidden` (FFN 2.75x)."""
    return ModelConfig(num_layers=4, hidden_size=hidden, ffn_hidden_size=int(hidden * 2.75) // 8 * 8,
                       num_attention_heads=4, num_query_groups=2, vocab_size=512, max_position_embeddings=256,
                       params_dtype="float32", make_vocab_size_divisible_by=PAD_VOCAB_TO)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _holds_training_weights(target, chunks, cfg) -> bool:
    """Every generation parameter equals its training counterpart with the TP=2 shards merged
    (`hf_mapping.unshard`: Megatron's split of QKV and SwiGLU is not a plain concatenation)."""
    from megatron.core import parallel_state as ps

    from megatron_rlhf.models import hf_mapping as H

    group = ps.get_tensor_model_parallel_group()
    train, gen = H.named_global_parameters(chunks), H.named_global_parameters([target])
    ok = sorted(train) == sorted(gen)
    for name, p in train.items():
        rule, _ = H.match_megatron(name, cfg)
        shards = [p.detach()]
        if rule.kind != "replicated":
            shards = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, p.detach().contiguous(), group=group)
        ok = ok and torch.equal(H.unshard(rule, shards, cfg), H.unshard(rule, [gen[name].detach()], cfg))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks share the cores)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from megatron.core.resharding import execute_reshard_plan

    from megatron_rlhf.rollout.hybrid import PLAN_ATTR, WeightSwap
    from megatron_rlhf.rollout.layout import build_in_layout, tp_only_layout

    cfg = model_config(args.hidden)
    train = ParallelConfig(tp=2)
    init.initialize(train, seed=7)
    if dist.get_world_size() != 2:
        raise SystemExit(f"rollout_swap.py needs 2 ranks, got {dist.get_world_size()}: run it under torchrun --nproc_per_node 2")
    chunks = build_model(cfg, train)
    target = build_in_layout(cfg, train.tp, tp_only_layout(1))
    swap = WeightSwap(chunks, target)
    swap()  # warm-up: builds the plan (once per PPO run)
    correct = _holds_training_weights(target, chunks, cfg)
    nbytes = sum(p.numel() * p.element_size() for p in target.parameters())
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (first touch of the pages)

    def megatron_executor():  # the same cached plan through megatron-core's executor and gloo service
        execute_reshard_plan(getattr(swap.target, PLAN_ATTR), swap.source, swap.target, service=swap.service)

    swaps, copies, theirs = [], [], []
    for _ in range(args.repeats):  # alternating, so background load hits all alike
        for fn, times in ((swap, swaps), (lambda: dst.copy_(src), copies), (megatron_executor, theirs)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(_slowest(time.perf_counter() - t))
    correct = correct and _holds_training_weights(target, chunks, cfg)
    swap_s, copy_s, theirs_s = statistics.median(swaps), statistics.median(copies), statistics.median(theirs)
    result = {
        "swap_correct": correct, "swap_bytes_per_rank": nbytes, "swap_plans_built": swap.plans_built,
        "swap_gib_per_s": nbytes / swap_s / 2**30, "memcpy_gib_per_s": nbytes / copy_s / 2**30,
        "swap_ratio_vs_memcpy": copy_s / swap_s, "swap_seconds_median": swap_s, "memcpy_seconds_median": copy_s,
        "swap_speedup_vs_megatron_executor": theirs_s / swap_s, "megatron_executor_seconds_median": theirs_s,
        "swap_hidden": args.hidden, "swap_repeats": args.repeats, "swap_threads_per_rank": args.threads,
    }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    init.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
