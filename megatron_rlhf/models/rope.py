"""Rotary position embedding for Megatron's unfused path, with the same arithmetic in fewer passes.

Without Transformer Engine (CPU, or a GPU build without it) Megatron-Core applies RoPE to the queries and
keys of every layer with `rope_utils._apply_rotary_pos_emb_bshd`: slice, ``t * cos``, a rotated copy
(chunk, negate, cat), ``* sin``, add, then a cat with the (usually empty) unrotated tail. At the
SmolLM2-135M shape those copies cost about 3 s of a 60 s PPO iteration on 2 CPU threads (benchmarks/
ppo_iteration.py --profile: `aten::cat` alone 3.6 s). `install()` routes the common case (rotation over
the whole head, not interleaved, no multi-latent attention, mscale 1) through `_Rope`, which writes each
half once; anything else still takes Megatron's own function.

The results equal Megatron's bit for bit, forward and backward: every element is the same two roundings
(``x1 * c - x2 * s`` is ``x1 * c + (-x2) * s``; ``x2 * c + x1 * s``), in the parameters' dtype.
"""

from __future__ import annotations

import torch

_installed = False


class _Rope(torch.autograd.Function):
    """t [s, b, h, d] rotated by angles with cos / sin [s, 1, 1, d / 2] (each half's shared angles)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, sign=1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1), None, None  # the transpose of a rotation: the angle negated


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """[x1, x2] -> [x1 c - x2 s, x2 c + x1 s] (sign 1) or [x1 c + x2 s, x2 c - x1 s] (sign -1)."""
    half = t.shape[-1] // 2
    x1, x2 = t[..., :half], t[..., half:]
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    torch.mul(x2, cos, out=o2)
    if sign > 0:
        o1.sub_(x2 * sin)
        o2.add_(x1 * sin)
    else:
        o1.add_(x2 * sin)
        o2.sub_(x1 * sin)
    return out


_angles: dict = {}  # dtype -> (freqs, its version, cos, sin): the last angles seen


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype):
    """cos / sin [s, 1, 1, d / 2] of freqs [s, 1, 1, d], in `dtype` as Megatron casts them. Megatron's
    non-interleaved angles are [f, f] (cat of the half-size frequencies with themselves), so one half serves
    both halves. Every layer's queries and keys of a forward get the same `freqs` tensor (and Megatron's
    rotary embedding caches it per sequence length), so they are computed once for all of them, not twice per
    layer (4 small ops each time)."""
    hit = _angles.get(dtype)
    if hit is not None and hit[0] is freqs and hit[1] == freqs._version \
            and hit[2].is_inference() == torch.is_inference_mode_enabled():  # autograd cannot save inference tensors
        return hit[2], hit[3]
    half = freqs[..., : freqs.shape[-1] // 2]
    cos, sin = torch.cos(half).to(dtype), torch.sin(half).to(dtype)
    _angles[dtype] = (freqs, freqs._version, cos, sin)
    return cos, sin


_packed_angles: dict = {}  # dtype -> (freqs, cu_seqlens, cos, sin): the last pack's angles


def _packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, dtype: torch.dtype):
    """cos / sin [t, 1, 1, d / 2] of a pack whose sequences start at cu_seqlens[:-1]: position p of each
    sequence takes freqs[p], the angle its padded row has there (so the rotation is the padded one, bit for bit)."""
    hit = _packed_angles.get(dtype)
    if hit is not None and hit[0] is freqs and hit[1] is cu_seqlens \
            and hit[2].is_inference() == torch.is_inference_mode_enabled():
        return hit[2], hit[3]
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    positions = torch.arange(int(cu[-1]), device=freqs.device) - torch.repeat_interleave(cu[:-1], lengths)
    cos, sin = _cos_sin(freqs, dtype)
    cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    _packed_angles[dtype] = (freqs, cu_seqlens, cos, sin)
    return cos, sin


def install() -> None:
    """Route Megatron's unfused bshd and thd (packed) RoPE through `_Rope` where it applies (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.models.common.embeddings import rope_utils

    megatron_rope = rope_utils._apply_rotary_pos_emb_bshd

    def apply_rope(t, freqs, rotary_interleaved=False, *args, **kwargs):
        # After rotary_interleaved: the MLA interleaving flag (named multi_latent_attention in megatron-core 0.16,
        # mla_rotary_interleaved in 0.19), then mscale; callers pass them by position or by name.
        mla = args[0] if args else kwargs.get("mla_rotary_interleaved") or kwargs.get("multi_latent_attention")
        mscale = args[1] if len(args) > 1 else kwargs.get("mscale", 1.0)
        d = freqs.shape[-1]
        if rotary_interleaved or mla or mscale != 1.0 or d != t.shape[-1] or d % 2:
            return megatron_rope(t, freqs, rotary_interleaved, *args, **kwargs)
        return _Rope.apply(t, *_cos_sin(freqs, t.dtype))

    apply_rope.megatron = megatron_rope
    rope_utils._apply_rotary_pos_emb_bshd = apply_rope

    megatron_thd = rope_utils._apply_rotary_pos_emb_thd

    def apply_rope_thd(t, cu_seqlens, freqs, rotary_interleaved=False, *args, **kwargs):
        # Packed sequences (models/packing.py): positions restart at each cu_seqlens boundary. Megatron's own
        # function splits t per sequence and concatenates the angles on every call (two per layer); here the
        # pack's angles are gathered once per forward, then rotated as one [t, 1, h, d] block.
        mla = args[0] if args else kwargs.get("mla_rotary_interleaved") or kwargs.get("multi_latent_attention")
        mscale = args[1] if len(args) > 1 else kwargs.get("mscale", 1.0)
        cp_group = args[2] if len(args) > 2 else kwargs.get("cp_group")
        d = freqs.shape[-1]
        if rotary_interleaved or mla or mscale != 1.0 or d != t.shape[-1] or d % 2 or \
                (cp_group is not None and cp_group.size() > 1):
            return megatron_thd(t, cu_seqlens, freqs, rotary_interleaved, *args, **kwargs)
        return _Rope.apply(t.unsqueeze(1), *_packed_cos_sin(freqs, cu_seqlens, t.dtype)).squeeze(1)

    apply_rope_thd.megatron = megatron_thd
    rope_utils._apply_rotary_pos_emb_thd = apply_rope_thd
    _installed = True
