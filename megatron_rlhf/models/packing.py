"""Packed sequences: a micro-batch's rows laid end to end in one row, each attending only to itself.

A right-padded micro-batch [b, s] spends the model's work on b * s positions; its rows hold sum(lengths).
`pack` lays the real tokens of every row end to end, [1, W] with W = sum(lengths) rounded up to the multiple
the layout needs (TP with sequence parallelism: W % tp == 0; a pipeline: one W for every micro-batch of a
step), and describes the boundaries in Megatron's `PackedSeqParams` (THD format, `cu_seqlens`). Megatron's
attention then restarts the rotary positions at each boundary, and core attention is causal within each
sequence: Transformer Engine's fused attention on GPU; `SDPAttention` (models/sdpa_attention.py) on the local
spec. The tail padding is a sequence of its own, so it is never attended to.

The model's last stage returns outputs over the pack, [1, W, X]; `unpack` lays them back out as [b, s, X]
(row i, position t -> pack position start_i + min(t, length_i - 1)), so every loss and read-out that takes a
padded micro-batch takes a packed one unchanged. An LM forward inside `logits_at` projects only the pack
positions of the requested rows (`pack_rows`), [1, b * T, V] viewed as [b, T, V].

Exactness: each packed sequence is computed by the same per-token operations as its padded row, so packed
equals padded up to the GEMM kernels' rounding for another row count (tests/unit/test_packing.py: 1e-6), and
no sequence reads another: changing one leaves every other one's outputs bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import unwrap_model


@dataclass
class SegmentParams(PackedSeqParams):
    """`PackedSeqParams` with its segment lengths as Python ints (core attention splits by them without a
    device sync per layer)."""

    segments: List[int] = field(default_factory=list)
    blocks: Optional[tuple] = None  # core attention's grouping of the segments (models/sdpa_attention.py)


@dataclass
class Pack:
    """A micro-batch's rows as one packed row.

    input_ids, position_ids [1, W] long (positions restart at 0 for every sequence); starts, lengths [b] long
    (where each row begins in the pack, and its tokens); params: the boundaries for Megatron's attention."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    params: SegmentParams

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


_settings = {"enabled": False, "multiple": 1, "min_saving": 0.1}


def configure(enabled: bool, sequence_multiple: int = 1, min_saving: float = 0.1) -> None:
    """Packing on or off for this process's forwards (`train.packing`, set when a run starts), the multiple a
    pack's width rounds up to (the TP size under sequence parallelism), and the least share of a step's padded
    tokens packing must remove to be used (`worth_packing`)."""
    _settings.update(enabled=bool(enabled), multiple=max(1, int(sequence_multiple)), min_saving=float(min_saving))


def pad_widths(microbatches: List[dict], same_width: bool = False) -> List[dict]:
    """Padded micro-batches with input_ids [b, s] right-padded (zeros) to the widths the layout needs: s a multiple
    of `sequence_multiple()` (sequence parallelism splits the sequence over the TP ranks), and with `same_width`
    (a pipeline: stages exchange activations of one shape) one s for all. Right padding changes no causal output
    at a real position. Micro-batches that change are new dicts; their other tensors are shared."""
    multiple = sequence_multiple()
    widths = [mb["input_ids"].shape[1] for mb in microbatches]
    if same_width and widths:
        widths = [max(widths)] * len(widths)
    out = []
    for mb, width in zip(microbatches, widths):
        grow = -(-width // multiple) * multiple - mb["input_ids"].shape[1]
        out.append({**mb, "input_ids": torch.nn.functional.pad(mb["input_ids"], (0, grow))} if grow else mb)
    return out


def enabled() -> bool:
    return _settings["enabled"]


def sequence_multiple() -> int:
    return _settings["multiple"]


def worth_packing(padded_tokens: int, packed_tokens: int) -> bool:
    """Whether a step whose forwards hold `padded_tokens` padded and `packed_tokens` packed runs packed. A pack
    costs a gather and a scatter of q, k and v per layer (models/sdpa_attention.py); with under `min_saving`
    (10%) of padding to remove they cost more than they save (benchmarks/packing.py, the fixed-length mix:
    the padded step was 3% faster at 5% padding), so such a step runs padded; the results agree either way."""
    return packed_tokens <= (1.0 - _settings["min_saving"]) * padded_tokens


def last_stage(model: torch.nn.Module) -> bool:
    """Whether this chunk (wrapped or not) computes the model's output (the last pipeline stage)."""
    return bool(getattr(unwrap_model(model), "post_process", True))


def first_stage(model: torch.nn.Module) -> bool:
    """Whether this chunk (wrapped or not) embeds the tokens (the first pipeline stage)."""
    return bool(getattr(unwrap_model(model), "pre_process", True))


_tokens = {"real": 0, "processed": 0}


def count_tokens(real: int | torch.Tensor, processed: int) -> None:
    """One first-stage forward (trainer/step.py `model_forward`): its rows' real tokens (a 0-dim tensor is summed
    where it lives, so a micro-batch on the GPU costs no device sync here) and the tokens it ran."""
    _tokens["real"] = _tokens["real"] + real
    _tokens["processed"] += int(processed)


def take_real_token_fraction() -> float | None:
    """Real tokens / tokens processed over this process's forwards since the last call (None: there were none),
    the share of the work that was not padding (`perf/real_token_fraction`); the tally starts again."""
    real, processed = float(_tokens["real"]), _tokens["processed"]
    _tokens.update(real=0, processed=0)
    return real / processed if processed else None


def packed_width(lengths: Sequence[int] | torch.Tensor, multiple: int = 1) -> int:
    """Tokens of the pack of rows of these lengths (each at least 1), rounded up to `multiple`."""
    total = int(torch.as_tensor(lengths).clamp(min=1).sum())
    return -(-total // multiple) * multiple


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, width: Optional[int] = None, multiple: int = 1) -> Pack:
    """input_ids [b, s] right-padded, lengths [b] -> a `Pack` [1, W]: W = `width`, or the tokens rounded up to
    `multiple`. A row of length 0 keeps one (padding) token, so every row has a last position to read."""
    b, s = input_ids.shape
    lengths = lengths.to(input_ids.device).long().clamp(min=1, max=s)
    total = int(lengths.sum())
    W = width if width is not None else packed_width(lengths, multiple)
    if W < total:
        raise ValueError(f"a pack of width {W} cannot hold {total} tokens")
    ids = _laid_end_to_end(input_ids, lengths, W)
    segments = lengths.tolist() + ([W - total] if W > total else [])
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
    seg = torch.tensor(segments, dtype=torch.long)
    starts = cu[:-1].long()
    positions = torch.arange(W) - torch.repeat_interleave(starts, seg)
    cu = cu.to(input_ids.device)
    params = SegmentParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(segments),
                           max_seqlen_kv=max(segments), segments=segments)
    return Pack(ids.unsqueeze(0), positions.unsqueeze(0).to(input_ids.device), starts[:b].to(input_ids.device),
                lengths, params)


def pack_rows(rows: torch.Tensor, packed: Pack) -> torch.Tensor:
    """rows [b, T] (positions within each row) -> [1, b * T] positions in the pack (clamped to the row's last
    token: a padded position reads a real one, which the caller's mask drops)."""
    inside = torch.minimum(rows.to(packed.starts.device), (packed.lengths - 1).unsqueeze(1))
    return (packed.starts.unsqueeze(1) + inside).reshape(1, -1)


def unpack(output: torch.Tensor, packed: Pack, s: int) -> torch.Tensor:
    """Pack outputs [1, W, *X] -> [b, s, *X] in the padded layout (a padded position holds its row's last
    output). Differentiable: the gradient of each pack position sums over the places it was copied to."""
    index = pack_rows(torch.arange(s, device=packed.starts.device).expand(packed.starts.shape[0], s), packed)
    return output[0].index_select(0, index[0]).view(packed.starts.shape[0], s, *output.shape[2:])


def pack_values(values: torch.Tensor, packed: Pack) -> torch.Tensor:
    """Per-position values [b, s] (e.g. labels) -> [1, W] at the pack positions of the real tokens (0 after)."""
    return _laid_end_to_end(values, packed.lengths, packed.width).unsqueeze(0)


def _laid_end_to_end(values: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[b, s] right-padded, lengths [b] -> [width]: row 0's first lengths[0] values, then row 1's..., then 0."""
    real = torch.arange(values.shape[1], device=values.device).unsqueeze(0) < lengths.to(values.device).unsqueeze(1)
    flat = values[real]
    return torch.nn.functional.pad(flat, (0, width - flat.numel()))
