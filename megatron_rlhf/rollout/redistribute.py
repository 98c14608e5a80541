"""Moving rollout data between the training layout and the generation layout (rollout/hybrid.py).

Order is always the training data-parallel order: the global batch of B rows is training DP rank 0's
prompts, then rank 1's, and so on. Generation DP rank g decodes the contiguous rows
[g * n, (g + 1) * n) with n = ceil(B / generation DP) (the last rank's tail is padded with copies of
the last row, decoded and dropped). The decoded rows are gathered back in generation DP order and
every rank takes the rows of its own training DP share, so:

- nothing is duplicated or lost: each global row is decoded by exactly one generation DP rank and
  returned to exactly one training DP share;
- every rank of a training model-parallel group gets the same rows, all from the same sources
  (one representative per training share and per generation DP rank sends; the others send None).

Rows are moved as pickled CPU tensors with `all_gather_object` over the world: a rollout batch is
kilobytes, next to the megabytes of weights the swap moves.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

Rows = Dict[str, torch.Tensor]


def gather_shares(share: Optional[Rows], index: int) -> List[Rows]:
    """Collective over the world: the shares of all representatives, ordered by `index`.

    share: this rank's rows (every tensor [n_i, ...]) if it represents part `index`, else None.
    Exactly one representative per index is expected (two would duplicate rows: refused).
    """
    if share is not None:
        share = {k: v.detach().cpu() for k, v in share.items()}
    gathered: List[Optional[Tuple[int, Optional[Rows]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (index, share))
    found = sorted(((i, s) for i, s in gathered if s is not None), key=lambda pair: pair[0])
    indices = [i for i, _ in found]
    if indices != list(range(len(indices))):
        raise RuntimeError(f"rollout redistribution: expected one representative per part 0..n-1, got parts {indices}")
    return [s for _, s in found]


def concat_prompts(shares: List[Rows], pad_id: int) -> Rows:
    """Left-padded prompt shares of different widths -> one left-padded batch [B, s_max].

    Each share: input_ids [n_i, s_i] long, attention_mask [n_i, s_i] bool, and optionally
    uniforms [n_i, T] (the per-row sampling draws, which travel with their rows)."""
    width = max(s["input_ids"].shape[1] for s in shares)
    ids, mask = [], []
    for s in shares:
        extra = width - s["input_ids"].shape[1]
        ids.append(torch.nn.functional.pad(s["input_ids"], (extra, 0), value=pad_id))
        mask.append(torch.nn.functional.pad(s["attention_mask"].bool(), (extra, 0), value=False))
    out = {"input_ids": torch.cat(ids), "attention_mask": torch.cat(mask)}
    if "uniforms" in shares[0]:
        out["uniforms"] = torch.cat([s["uniforms"] for s in shares])
    return out


def part_rows(total: int, parts: int, part: int) -> Tuple[torch.Tensor, int]:
    """Row indices [n] of the global batch that part `part` of `parts` decodes (n = ceil(total / parts)),
    and how many of them are real (the rest repeat the last row to keep every part the same size)."""
    n = -(-total // parts)
    start = part * n
    index = torch.arange(start, start + n).clamp(max=total - 1)
    return index, max(0, min(n, total - start))


def take(rows: Rows, index: torch.Tensor) -> Rows:
    return {k: v[index] for k, v in rows.items()}


def concat_parts(parts: List[Rows], real: List[int]) -> Rows:
    """Decoded parts in order -> the global batch, padding rows dropped."""
    return {k: torch.cat([p[k][:n] for p, n in zip(parts, real)]) for k in parts[0]}


def share_bounds(sizes: List[int], index: int) -> slice:
    """Rows of share `index` in the concatenation of shares of `sizes`."""
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])
