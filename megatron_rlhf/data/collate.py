"""Collation: tokenized examples -> padded batch tensors for the model, and a step's micro-batches.

SFT and preference batches are right-padded (the model's default causal mask is then enough);
prompts for generation are left-padded so every prompt ends at the same column. `pad_to` and
`multiple_of` fix or round the width (sequence parallel needs s % tp == 0; pipelines a fixed s).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


def _target_length(lengths: Sequence[int], pad_to: Optional[int], multiple_of: int) -> int:
    longest = max(lengths) if lengths else 0
    if pad_to is not None:
        if longest > pad_to:
            raise ValueError(f"an example has {longest} tokens, more than pad_to={pad_to}")
        longest = pad_to
    return -(-longest // multiple_of) * multiple_of


def pad_sequences(
    seqs: Sequence[Sequence[int]],
    pad_value: float,
    *,
    side: str = "right",
    pad_to: Optional[int] = None,
    multiple_of: int = 1,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """[b, s] tensor of `seqs` padded with `pad_value` on `side` to the longest (or `pad_to`),
    rounded up to `multiple_of` (sequence parallel needs s % tp == 0; pipelines need a fixed s)."""
    s = _target_length([len(x) for x in seqs], pad_to, multiple_of)
    out = torch.full((len(seqs), s), pad_value, dtype=dtype)
    for i, x in enumerate(seqs):
        if len(x):
            if side == "right":
                out[i, : len(x)] = torch.as_tensor(x, dtype=dtype)
            else:
                out[i, s - len(x) :] = torch.as_tensor(x, dtype=dtype)
    return out


def _common(seqs: Sequence[Sequence[int]], pad_id: int, pad_to: Optional[int], multiple_of: int) -> Dict[str, torch.Tensor]:
    ids = pad_sequences(seqs, pad_id, pad_to=pad_to, multiple_of=multiple_of)
    lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous()
    return {
        "input_ids": ids,  # [b, s] long
        "attention_mask": positions < lengths.unsqueeze(1),  # [b, s] bool, True at real tokens
        "position_ids": positions,  # [b, s] long
        "lengths": lengths,  # [b] long
    }


def collate_sft(
    examples: Sequence[Dict[str, Any]], pad_id: int, pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """SFT examples -> right-padded batch.

    input_ids, labels [b, s] long; loss_mask [b, s] float32; attention_mask [b, s] bool; position_ids
    [b, s]; lengths [b]. Next-token targets are already shifted: the loss at position t is
    ``CE(logits[:, t], labels[:, t]) * loss_mask[:, t]`` (labels[:, t] = input_ids[:, t + 1]).
    Right padding keeps the real tokens causal, so the model's default causal mask is enough.
    """
    batch = _common([e["input_ids"] for e in examples], pad_id, pad_to, multiple_of)
    ids = batch["input_ids"]
    mask = pad_sequences([e["loss_mask"] for e in examples], 0, pad_to=ids.shape[1], dtype=torch.float32)
    labels = torch.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    loss_mask = torch.zeros_like(mask)
    loss_mask[:, :-1] = mask[:, 1:]
    batch.update(labels=labels, loss_mask=loss_mask)
    return batch


def collate_preference(
    examples: Sequence[Dict[str, Any]], pad_id: int, pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """Preference pairs -> one right-padded batch of 2b sequences: rows [0, b) are chosen, [b, 2b)
    rejected (one forward pass scores both). input_ids, attention_mask, position_ids [2b, s];
    lengths [2b] (the score is read at ``lengths - 1``, the last real token); prompt_lens [b]."""
    seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    batch = _common(seqs, pad_id, pad_to, multiple_of)
    batch["prompt_lens"] = torch.tensor([e["prompt_len"] for e in examples], dtype=torch.long)
    return batch


def collate_prompts(
    examples: Sequence[Dict[str, Any]], pad_id: int, side: str = "left", pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """Prompts for generation, left-padded by default so every prompt ends at the same column.
    input_ids [b, s]; attention_mask [b, s] bool; position_ids [b, s] (0 at each prompt's first real
    token, 0 on padding); lengths [b]."""
    seqs = [e["prompt_ids"] for e in examples]
    ids = pad_sequences(seqs, pad_id, side=side, pad_to=pad_to, multiple_of=multiple_of)
    lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    cols = torch.arange(ids.shape[1]).unsqueeze(0)
    if side == "left":
        attention = cols >= (ids.shape[1] - lengths).unsqueeze(1)
    else:
        attention = cols < lengths.unsqueeze(1)
    positions = (attention.long().cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions, "lengths": lengths}


COLLATE = {"sft": collate_sft, "preference": collate_preference, "prompt": collate_prompts}


class TokenBudgetError(ValueError):
    """A row is longer than the token budget of a micro-batch."""


def token_groups(lengths: Sequence[int], micro_batch_size: int, max_tokens: Optional[int] = None,
                 packed: bool = False) -> List[range]:
    """Consecutive rows of these token counts -> the row ranges of a step's micro-batches.

    Without packing and without `max_tokens` (train.max_tokens_per_micro_batch): `micro_batch_size` rows each.
    Otherwise token-budget micro-batches: as many consecutive rows as fit `max_tokens` tokens of the forward
    (packed: their sum; padded: rows x the longest), the budget defaulting to `micro_batch_size` rows of the
    step's longest row, so no micro-batch holds more than a padded one of the step would. Every rank of a
    pipeline holds the same rows, so it cuts the same micro-batches. Losses are normalised by the step's global
    token (or pair) count, so the grouping changes no result beyond rounding.
    `packed`: whether the forwards run packed (models/packing.py `enabled`)."""
    lengths = [max(1, int(n)) for n in lengths]
    if max_tokens is None and not packed:
        return [range(s, min(s + micro_batch_size, len(lengths))) for s in range(0, len(lengths), micro_batch_size)]
    longest = max(lengths, default=1)
    budget = max_tokens if max_tokens is not None else micro_batch_size * longest
    if longest > budget:
        raise TokenBudgetError(f"a row of {longest} tokens is longer than train.max_tokens_per_micro_batch={budget}: "
                               f"raise it to at least {longest}, or shorten the rows")
    groups, start, tokens, widest = [], 0, 0, 0
    for i, n in enumerate(lengths):
        grown = tokens + n if packed else (i - start + 1) * max(widest, n)
        if i > start and grown > budget:
            groups.append(range(start, i))
            start, tokens, widest = i, 0, 0
        tokens, widest = tokens + n, max(widest, n)
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


def example_tokens(example: Dict[str, Any]) -> int:
    """Tokens an example puts into a forward: an SFT row's, a preference pair's two rows'."""
    if "chosen_ids" in example:
        return len(example["chosen_ids"]) + len(example["rejected_ids"])
    return len(example["input_ids"] if "input_ids" in example else example["prompt_ids"])


def dataset_tokens(dataset, indices: Optional[Sequence[int]] = None) -> List[int]:
    """`example_tokens` of the examples at `indices` (None: all) of a list or a `datasets.Dataset` (its length
    columns read once)."""
    indices = list(range(len(dataset))) if indices is None else [int(i) for i in indices]
    if isinstance(dataset, (list, tuple)):
        return [example_tokens(dataset[i]) for i in indices]
    return _column_lengths(dataset, indices)


def microbatches(dataset, indices: Sequence[int], micro_batch_size: int, collate: Callable,
                 max_tokens: Optional[int] = None, packed: bool = False, **kwargs) -> List[Dict]:
    """This rank's share of one step, as a list of collated micro-batches (for Megatron's schedule:
    ``forward_backward_func(data_iterator=iter(mbs), num_microbatches=len(mbs), ...)``): consecutive indices,
    `micro_batch_size` per micro-batch, or token-budget micro-batches (`token_groups`)."""
    if len(indices) % micro_batch_size != 0:
        raise ValueError(f"{len(indices)} indices do not split into micro-batches of {micro_batch_size}")
    indices = [int(i) for i in indices]
    lengths = dataset_tokens(dataset, indices)
    out = []
    for group in token_groups(lengths, micro_batch_size, max_tokens, packed):
        idx = indices[group.start: group.stop]
        if isinstance(dataset, (list, tuple)):
            rows = [dataset[i] for i in idx]
        else:  # datasets.Dataset: one batched read returns columns
            cols = dataset[idx]
            rows = [{k: cols[k][i] for k in cols} for i in range(len(idx))]
        out.append(collate(rows, **kwargs))
    return out


def _column_lengths(dataset, indices: List[int]) -> List[int]:
    names = dataset.column_names
    if "chosen_ids" in names:
        cols = dataset.select_columns(["chosen_ids", "rejected_ids"])[indices]
        return [len(a) + len(b) for a, b in zip(cols["chosen_ids"], cols["rejected_ids"])]
    name = "input_ids" if "input_ids" in names else "prompt_ids"
    return [len(x) for x in dataset.select_columns([name])[indices][name]]
