"""A decode-specialised forward over a Megatron `GPTModel`'s own parameters, for the KV-cache sampler.

Why: a cProfile of `generate` at 16 rows x 64 tokens on benchmarks/rollout.py's reference model
(4 layers, fp32, 2 threads) put ~85% of the time in Megatron's module stack, not in compute: RoPE
alone ~35% (the static inference context caches keys BEFORE rotation, so every step recomputes
cos/sin of the whole angle table and re-rotates the whole key cache of every layer), the
autograd.Function wrappers of the parallel linears ~25% beyond their matmuls, and module calls,
argument plumbing and bias-dropout-add the rest.

`LeanDecoder` computes the same function with plain torch ops: RMSNorm (`F.rms_norm`, what the local
spec's torch `RMSNorm` calls, bit-identical to models/norm_glu.py's on CPU), Megatron's fused QKV layout
(per query group: its q heads, then k, then v), RoPE from the model's own `RotaryEmbedding` (base,
percent, llama3 / linear scaling, interleaved or not), applied once per token with keys cached AFTER
rotation, SDPA over the cache (GQA), the output projection, SwiGLU (fc1 = [gate; up] per TP shard),
fc2, the final norm and the output layer (its own weight, or the embedding's when tied). Biases where the model has them.

Parameters are read in place (detached views, no copies) when a decoder is built, i.e. at each
`generate` call, so optimizer steps and weight swaps are seen at once. With TP > 1 the shards stay
where they are: column-parallel weights hold this rank's heads / FFN slice / vocab slice, the two
row-parallel outputs of each layer are all-reduced over the modules' own TP group, and logits are
gathered over it (as `runtime_gather_output=True` does).

Anything this file does not implement is detected up front by `unsupported_reason` (module types
and config flags), and the sampler then runs Megatron's own forward: see
`megatron_engine.decode_path`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# TransformerConfig settings the lean forward does not implement, each with the value it assumes.
_CONFIG_MUST_BE = {
    "multi_latent_attention": False, "num_moe_experts": None, "mtp_num_layers": None, "fp8": None,
    "fp4": None, "window_size": None, "softmax_type": "vanilla", "apply_query_key_layer_scaling": False,
    "qk_l2_norm": False, "attention_output_gate": False, "no_rope_freq": None,
    "fp32_residual_connection": False, "apply_residual_connection_post_layernorm": False,
    "layernorm_zero_centered_gamma": False, "gated_linear_unit": True, "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None, "sequence_parallel": False,
    "context_parallel_size": 1, "experimental_attention_variant": None, "is_hybrid_model": False,
    "inference_fuse_tp_communication": False, "flash_decode": False,
}


def unsupported_reason(gpt) -> Optional[str]:
    """None when `LeanDecoder` computes `gpt`'s forward; otherwise a short reason why it does not."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_rlhf.models.norm_glu import RMSNorm, SwiGLU
    from megatron_rlhf.models.sdpa_attention import SDPAttention

    config = gpt.config
    for name, value in _CONFIG_MUST_BE.items():
        if getattr(config, name, value) != value:
            return f"config.{name}={getattr(config, name)!r}"
    if config.activation_func is not F.silu:
        return f"activation {getattr(config.activation_func, '__name__', config.activation_func)} (SwiGLU needs silu)"
    if not (gpt.pre_process and gpt.post_process):
        return "a pipeline stage without the embedding or the output layer"
    if getattr(gpt, "position_embedding_type", None) != "rope" or type(getattr(gpt, "rotary_pos_emb", None)) is not RotaryEmbedding:
        return f"position embedding {getattr(gpt, 'position_embedding_type', None)!r} (only plain rope)"
    if type(gpt.embedding.word_embeddings) is not VocabParallelEmbedding or gpt.embedding.add_position_embedding \
            or getattr(gpt.embedding, "tokentype_embeddings", None) is not None:
        return "an embedding other than a lone VocabParallelEmbedding"
    if not isinstance(gpt.output_layer, ColumnParallelLinear) or gpt.output_layer.bias is not None:
        return f"output layer {type(gpt.output_layer).__name__} (only a bias-free ColumnParallelLinear)"
    norms = [gpt.decoder.final_layernorm]
    for i, layer in enumerate(gpt.decoder.layers):
        attn, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
        if type(layer) is not TransformerLayer or type(attn) is not SelfAttention or type(mlp) is not MLP:
            return f"layer {i} is not a local-spec TransformerLayer(SelfAttention, MLP) (Transformer Engine or MoE spec)"
        if type(attn.core_attention) not in (DotProductAttention, SDPAttention):
            return f"layer {i} core attention {type(attn.core_attention).__name__}"
        linears = (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
        if [type(m) for m in linears] != [ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear]:
            return f"layer {i} linear modules {[type(m).__name__ for m in linears]}"
        for extra in ("q_layernorm", "k_layernorm"):
            if not isinstance(getattr(attn, extra, None), (IdentityOp, type(None))):
                return f"layer {i} has a {extra}"
        if not isinstance(layer.pre_cross_attn_layernorm, IdentityOp) or not isinstance(layer.cross_attention, IdentityOp):
            return f"layer {i} has cross attention"
        # Megatron's MLP calls a whole-GLU module with use_te_activation_func, else silu inside its own glu
        silu_glu = (isinstance(mlp.activation_func, SwiGLU) if config.use_te_activation_func
                    else mlp.activation_func is F.silu)
        if not silu_glu:
            return f"layer {i} MLP activation {type(mlp.activation_func).__name__} (only silu GLU)"
        if attn.num_query_groups_per_partition * attn.world_size != config.num_query_groups:
            return f"num_query_groups={config.num_query_groups} < tensor parallel size {attn.world_size}"
        norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
    for norm in norms:
        if type(norm) not in (torch.nn.RMSNorm, RMSNorm) or norm.weight is None:  # the same function
            return f"normalization {type(norm).__name__} (only torch RMSNorm with a weight)"
    return None


class LeanDecoder:
    """prefill / step over `gpt`'s parameters with a static KV cache per layer.

    gpt: a GPTModel for which `unsupported_reason(gpt)` is None (pp = 1, eval mode, no_grad).
    batch, width: rows and cache slots; slot j of every row holds the token fed j-th.
    Cache per layer: keys (rotated) and values [batch, width, local_query_groups, head_dim].
    """

    def __init__(self, gpt, batch: int, width: int):
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        emb = gpt.embedding.word_embeddings
        self.embed = emb.weight.detach()
        self.tp_group = emb.tp_group if emb.tp_group.size() > 1 else None
        self.vocab_start, self.vocab_end = emb.vocab_start_index, emb.vocab_end_index
        self.layers = [_Layer(layer, batch, width) for layer in gpt.decoder.layers]
        final = gpt.decoder.final_layernorm
        self.final_norm = (final.weight.detach(), final.eps)
        out_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight
        self.out_weight = out_weight.detach()
        self.out_group = gpt.output_layer.tp_group if gpt.output_layer.tp_group.size() > 1 else None
        # RoPE tables [width, rot]: the model's own angles (rotary_pos_emb: base, percent, scaling,
        # interleaving), cos / sin taken exactly as `_apply_rotary_pos_emb_bshd` takes them.
        rope = gpt.rotary_pos_emb
        freqs = rope(width)[:, 0, 0, :]  # [width, rot] fp32
        mscale = _yarn_get_concentration_factor_from_config(gpt.config)
        dtype = self.embed.dtype
        self.cos = (torch.cos(freqs) * mscale).to(dtype)
        sin = (torch.sin(freqs) * mscale).to(dtype)
        self.interleaved = bool(gpt.config.rotary_interleaved)
        rot = freqs.shape[-1]
        # rotate_half(x) * sin == swap(x) * signed_sin, swap = exchange the two halves (or the two
        # members of each pair when interleaved); the sign of rotate_half moves onto sin (exact).
        sign = torch.ones(rot, dtype=dtype, device=sin.device)
        if self.interleaved:
            sign[0::2] = -1
        else:
            sign[: rot // 2] = -1
        self.signed_sin = sin * sign
        self.rot = rot
        self.offset = 0  # cache slots filled so far

    # ----------------------------------------------------------------- public interface

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, n] for cache slots [0, n) -> next-token logits [b, V_padded] (last slot)."""
        if self.offset != 0:
            raise RuntimeError("prefill() fills an empty cache: build a new LeanDecoder for a new batch")
        return self._forward(tokens, positions)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, 1] for the next cache slot -> next-token logits [b, V_padded]."""
        if tokens.shape[1] != 1 or self.offset == 0:
            raise RuntimeError("step() takes one token per row, after prefill()")
        return self._forward(tokens, positions)

    # ----------------------------------------------------------------- the forward

    def _forward(self, tokens, positions):
        b, n = tokens.shape
        start, end = self.offset, self.offset + n
        h = self._embed(tokens)  # [b, n, H]
        # [b, n, 1, 1, rot]: broadcast over query groups and the (q heads + k) of each group
        cos = self.cos[positions].unsqueeze(2).unsqueeze(2)
        sin = self.signed_sin[positions].unsqueeze(2).unsqueeze(2)
        for layer in self.layers:
            h = layer.forward(h, cos, sin, start, end, self)
        self.offset = end
        w, eps = self.final_norm
        x = F.rms_norm(h[:, -1], w.shape, w, eps)  # only the last position's logits are used
        logits = F.linear(x, self.out_weight)  # [b, V_local]
        if self.out_group is not None:
            logits = _gather_last_dim(logits, self.out_group)
        return logits

    def _embed(self, tokens):
        if self.tp_group is None:
            return F.embedding(tokens, self.embed)
        # VocabParallelEmbedding: ids outside this rank's slice look up row 0, are zeroed, then summed.
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        h = F.embedding(local, self.embed)
        h[outside] = 0.0
        dist.all_reduce(h, group=self.tp_group)
        return h

    def rope(self, x, cos, sin):
        """x [..., head_dim] rotated by the angles of cos / sin [..., rot] (broadcast): a new tensor."""
        rot = self.rot
        part = x if rot == x.shape[-1] else x[..., :rot]
        if self.interleaved:
            swapped = part.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
        else:
            swapped = part.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)
        out = part * cos + swapped * sin
        return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


class _Layer:
    """One TransformerLayer's parameters (detached views) and its KV cache."""

    def __init__(self, layer, batch: int, width: int):
        attn, mlp = layer.self_attention, layer.mlp

        def w(m):
            return m.weight.detach(), (None if m.bias is None else m.bias.detach())

        self.norm1 = (layer.input_layernorm.weight.detach(), layer.input_layernorm.eps)
        self.norm2 = (layer.pre_mlp_layernorm.weight.detach(), layer.pre_mlp_layernorm.eps)
        self.qkv, self.proj = w(attn.linear_qkv), w(attn.linear_proj)
        fc1_weight, fc1_bias = w(mlp.linear_fc1)  # this rank's [gate; up] rows
        fc1_biases = (None, None) if fc1_bias is None else fc1_bias.chunk(2)
        self.fc1_halves = tuple(zip(fc1_weight.chunk(2, dim=0), fc1_biases))
        self.fc2 = w(mlp.linear_fc2)
        self.proj_group = attn.linear_proj.tp_group if attn.linear_proj.tp_group.size() > 1 else None
        self.fc2_group = mlp.linear_fc2.tp_group if mlp.linear_fc2.tp_group.size() > 1 else None
        self.groups = attn.num_query_groups_per_partition
        self.q_per_group = attn.num_attention_heads_per_partition // self.groups
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = attn.core_attention.softmax_scale
        shape = (batch, width, self.groups, self.head_dim)
        dtype, device = self.qkv[0].dtype, self.qkv[0].device
        self.k_cache = torch.empty(shape, dtype=dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device)

    def forward(self, h, cos, sin, start: int, end: int, dec: LeanDecoder):
        """h [b, n, H] (tokens for cache slots [start, end)) -> h [b, n, H] after this layer."""
        b, n, _ = h.shape
        g, qpg, hd = self.groups, self.q_per_group, self.head_dim
        w, eps = self.norm1
        qkv = F.linear(F.rms_norm(h, w.shape, w, eps), self.qkv[0])
        if self.qkv[1] is not None:
            qkv = qkv + self.qkv[1]
        qkv = qkv.view(b, n, g, qpg + 2, hd)  # per query group: its q heads, then k, then v
        qk = dec.rope(qkv[:, :, :, : qpg + 1], cos, sin)  # [b, n, g, qpg + 1, hd], keys rotated once
        self.k_cache[:, start:end] = qk[:, :, :, qpg]
        self.v_cache[:, start:end] = qkv[:, :, :, qpg + 1]
        keys = self.k_cache[:, :end].transpose(1, 2)  # [b, g, end, hd]
        values = self.v_cache[:, :end].transpose(1, 2)
        if n == 1 and start > 0:
            # One query per row: the q heads of a group are independent queries of that group's keys
            # (GQA), so they sit in SDPA's sequence axis [b, g, qpg, hd] and no head expansion is needed.
            ctx = F.scaled_dot_product_attention(qk[:, 0, :, :qpg], keys, values, scale=self.scale)
        else:
            if start != 0:
                raise RuntimeError("a block of several tokens must start at slot 0 (prefill)")
            q = qk[:, :, :, :qpg].reshape(b, n, g * qpg, hd).transpose(1, 2)  # [b, heads, n, hd]
            ctx = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=qpg > 1).transpose(1, 2)
        # head order g * qpg + j, as Megatron's [.., np * hn] context
        h = h + _row_parallel(ctx.reshape(b, n, g * qpg * hd), self.proj, self.proj_group)
        w, eps = self.norm2
        x = F.rms_norm(h, w.shape, w, eps)
        # Two GEMMs over fc1's halves, not one and a chunk: silu and the product then read contiguous
        # rows (over the strided halves of one [b, n, 2F] output they ran ~4x slower at 128 rows), and the
        # [b, 2F] GEMM was slower than its two halves in the decode loop (benchmarks/rollout.py).
        gate, lin = (F.linear(x, weight, bias) for weight, bias in self.fc1_halves)
        return h + _row_parallel(F.silu(gate) * lin, self.fc2, self.fc2_group)


def _row_parallel(x, weight_bias, group):
    """RowParallelLinear: local matmul, sum over TP, then the bias (added once, after the sum)."""
    weight, bias = weight_bias
    y = F.linear(x, weight)
    if group is not None:
        dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[b, V_local] on each TP rank -> [b, tp * V_local] in rank order (vocab-parallel logits)."""
    tp, (b, v) = group.size(), x.shape
    out = torch.empty((tp * b, v), dtype=x.dtype, device=x.device)  # ranks stacked on dim 0 (gloo wants that)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(tp, b, v).permute(1, 0, 2).reshape(b, tp * v)
