"""Global masked statistics over 2 gloo ranks equal the single-rank statistics of the concatenated batch.

Usage: torchrun --nproc_per_node 2 algo_whiten.py OUT.json
Every rank builds the same ragged global batch from a seed and keeps its own rows, padded to its own
width with NaN (ranks need not agree on shapes). Rank 0 writes the worst differences it gathered.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.algo.masked import masked_mean, masked_var, whiten
from megatron_rlhf.parallel import init

ROWS_PER_RANK = [3, 5]


def global_rows():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (sum(ROWS_PER_RANK),), generator=g)
    return [torch.randn(int(n), generator=g, dtype=torch.float64) * 2 + 0.5 for n in lengths]


def pad(rows, width):
    x = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.float64)
    for b, r in enumerate(rows):
        x[b, : len(r)] = r
        mask[b, : len(r)] = 1.0
    return x, mask


def main(out_path):
    init.init_process_group()
    rank, group = dist.get_rank(), dist.group.WORLD
    rows = global_rows()
    start = sum(ROWS_PER_RANK[:rank])
    mine = rows[start : start + ROWS_PER_RANK[rank]]
    x, mask = pad(mine, width=max(len(r) for r in mine) + rank)  # different widths per rank

    full_x, full_mask = pad(rows, width=max(len(r) for r in rows))
    ref_white = whiten(full_x, full_mask)[start : start + len(mine)]

    white = whiten(x, mask, group=group)
    diffs = {
        "mean": abs(masked_mean(x, mask, group) - masked_mean(full_x, full_mask)).item(),
        "var": abs(masked_var(x, mask, group) - masked_var(full_x, full_mask)).item(),
        "local_var_differs": abs(masked_var(x, mask) - masked_var(full_x, full_mask)).item(),
        "whiten": max(
            (white[b, : len(r)] - ref_white[b, : len(r)]).abs().max().item() for b, r in enumerate(mine)
        ),
        "whiten_padding_nonzero": float((white[mask == 0] != 0).sum().item()),
    }
    # d(global mean)/d(local x) = mask / (global token count), through the all-reduce.
    xg = x.clone().requires_grad_(True)
    masked_mean(xg, mask, group).backward()
    diffs["grad"] = (xg.grad - mask / full_mask.sum()).abs().max().item()

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    init.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
