"""Core attention of the local (non-Transformer-Engine) layer spec through `torch.nn.functional.
scaled_dot_product_attention`: one fused op instead of Megatron's `DotProductAttention` chain (GQA
`repeat_interleave` of the keys and values, `baddbmm`, mask fill, softmax, `bmm`, permutes).

Why: a profile of the PPO iteration on CPU (benchmarks/ppo_iteration.py) puts that chain among the
largest costs of the Megatron forward and backward, and in KV-cache decoding the `repeat_interleave`
copies the whole cache on every step. SDPA reads grouped keys in place (`enable_gqa`). On CPU a bf16 causal
block computes in fp32 (parallel/cpu.py item 9: torch's bf16 backward there is twice as slow).

Packed sequences (models/packing.py: THD query [t, np, hn] with `SegmentParams`) attend causally within each
sequence: sequences of similar length as one right-padded SDPA block, so no sequence reads another and none
waits on a [t, t] mask.

Only the cases the trainer and the sampler use take the fused path; everything else (an explicit
attention mask, sliding windows, softmax offsets, fp16 layer scaling, attention dropout in training,
a query block shorter than the keys but longer than one token) runs Megatron's own implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_rlhf.parallel import cpu


class SDPAttention(DotProductAttention):
    """Drop-in `core_attention`: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""

    def _fused_path_applies(self, query, key, attention_mask, attention_bias, packed_seq_params) -> bool:
        sq, sk = query.shape[0], key.shape[0]
        return (
            attention_mask is None
            and attention_bias is None
            and (packed_seq_params is None or _segments(packed_seq_params) is not None)
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and not self.config.apply_query_key_layer_scaling
            and not (self.training and self.attention_dropout.p > 0)
            and (sq == 1 or (sq == sk and self.attn_mask_type == AttnMaskType.causal))
        )

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None, packed_seq_params=None):
        if not self._fused_path_applies(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, hn] -> [b, heads, s, hn]; a causal block (training, scoring) in the dtype the CPU layer
        # picks (fp32 for bf16 on CPU); a decode step, which rereads the whole key cache, as it is
        dtype = cpu.attention_dtype(query) if sq > 1 else query.dtype
        q, k, v = (t.permute(1, 2, 0, 3).to(dtype) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=sq > 1, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        ).to(query.dtype)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query, key, value, params):
        """query [t, np, hn], key / value [t, ng, hn] (THD), causal within each segment -> [t, np * hn].

        Segments of similar length run as one right-padded block each (`_blocks`): a segment's padding comes
        after its tokens, so causal attention never reads it, and the padded rows' outputs are dropped."""
        dtype = cpu.attention_dtype(query)
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        outs = []
        blocks, take = _blocks(params)
        for index in blocks:  # [n, L] pack positions
            n, L = index.shape
            q, k, v = (t.index_select(0, index.reshape(-1)).view(n, L, *t.shape[1:]).transpose(1, 2).to(dtype)
                       for t in (query, key, value))  # [n, heads, L, hn]
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            outs.append(context.transpose(1, 2).reshape(n * L, self.hidden_size_per_partition))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.index_select(0, take.to(out.device)).to(query.dtype)


def _blocks(params, waste: float = 0.25):
    """([n, L] pack positions of each block of segments, [t] the row of the blocks' outputs that holds each pack
    position), cached on `params` (every layer of the forward reads the same). Segments sorted by length are
    cut into blocks whose padding stays under `waste` of their tokens: one block for a batch of similar
    lengths (one SDPA call, as a padded micro-batch makes), several for a long-tailed mix (no [L_max, L_max]
    attention for a short row)."""
    cached = getattr(params, "blocks", None)
    if cached is not None:
        return cached
    segments = params.segments
    starts = [0]
    for n in segments[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(segments)), key=lambda i: -segments[i])
    groups, current = [], []
    for i in order:
        trial = current + [i]
        longest = segments[trial[0]]
        if current and longest * len(trial) > (1 + waste) * sum(segments[j] for j in trial):
            groups.append(current)
            trial = [i]
        current = trial
    groups.append(current)
    device = params.cu_seqlens_q.device
    blocks, take, offset = [], torch.empty(sum(segments), dtype=torch.long), 0
    for group in groups:
        L = segments[group[0]]
        cols = torch.arange(L)
        rows = []
        for j in group:
            rows.append(starts[j] + cols.clamp(max=segments[j] - 1))  # padding reads the segment's last token
            take[starts[j]: starts[j] + segments[j]] = offset + torch.arange(segments[j])
            offset += L
        blocks.append(torch.stack(rows).to(device))
    params.blocks = (blocks, take.to(device))
    return params.blocks


def _segments(params):
    """The segment lengths of a THD `PackedSeqParams` made by models/packing.py, else None."""
    return getattr(params, "segments", None) if params.qkv_format == "thd" else None
