"""SDPAttention (the local spec's core attention) equals Megatron's DotProductAttention on the paths it
fuses (causal blocks in training and prefill, one-token decode steps, GQA) and defers to it otherwise."""

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_rlhf.models.sdpa_attention import SDPAttention
from megatron_rlhf.models.spec import ModelConfig, layer_spec, transformer_config
from megatron_rlhf.parallel.layout import ParallelConfig

HEADS, GROUPS, HN = 4, 2, 8


@pytest.fixture(scope="module")
def attention(world):
    cfg = transformer_config(ModelConfig(num_layers=1, hidden_size=HEADS * HN, ffn_hidden_size=64,
                                         num_attention_heads=HEADS, num_query_groups=GROUPS), ParallelConfig())
    return SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _qkv(sq, sk, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, HEADS, HN, generator=g, requires_grad=True)
    k = torch.randn(sk, b, GROUPS, HN, generator=g, requires_grad=True)
    v = torch.randn(sk, b, GROUPS, HN, generator=g, requires_grad=True)
    return q, k, v


def _both(attention, q, k, v, mask=None):
    """(fused output, Megatron's output) and their gradients w.r.t. q, k, v."""
    outs, grads = [], []
    for forward in (attention.forward, lambda *a: DotProductAttention.forward(attention, *a)):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = forward(qq, kk, vv, mask)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out)
        grads.append([t.grad for t in (qq, kk, vv)])
    return outs, grads


def test_local_spec_uses_it():
    assert layer_spec(te=False).submodules.self_attention.submodules.core_attention is SDPAttention


@pytest.mark.parametrize("sq,sk", [(7, 7), (1, 9)], ids=["causal block", "decode step"])
def test_equals_megatron_attention(attention, sq, sk):
    q, k, v = _qkv(sq, sk)
    assert attention._fused_path_applies(q, k, None, None, None)
    (fused, ref), (g_fused, g_ref) = _both(attention, q, k, v)
    assert fused.shape == (sq, 3, HEADS * HN)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_causal_mask_is_applied(attention):
    """Changing a later key must not change an earlier query's output."""
    q, k, v = _qkv(5, 5)
    out = attention(q, k, v, None)
    k2 = k.detach().clone()
    k2[4] += 10.0
    out2 = attention(q, k2, v, None)
    torch.testing.assert_close(out[:4], out2[:4])
    assert not torch.allclose(out[4], out2[4])


def test_explicit_mask_defers_to_megatron(attention):
    q, k, v = _qkv(4, 4)
    mask = torch.zeros(3, 1, 4, 4, dtype=torch.bool)
    mask[:, :, :, 0] = True  # hide key 0 from every query
    assert not attention._fused_path_applies(q, k, mask, None, None)
    (fused, ref), _ = _both(attention, q, k, v, mask)
    torch.testing.assert_close(fused, ref)


def test_bf16_causal_block_computes_in_fp32_on_cpu_and_decode_steps_keep_bf16(attention):
    """parallel/cpu.py item 9: a bf16 causal block is the fp32 attention of the same inputs, rounded once."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for (sq, sk), dtype in (((7, 7), torch.float32), ((1, 9), torch.bfloat16)):
        q, k, v = (t.detach().to(torch.bfloat16) for t in _qkv(sq, sk))
        out = attention.forward(q, k, v, None)
        ref = sdpa(*(t.permute(1, 2, 0, 3).to(dtype) for t in (q, k, v)), is_causal=sq > 1,
                   scale=attention.softmax_scale, enable_gqa=True)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, ref.to(torch.bfloat16).permute(2, 0, 1, 3).reshape(sq, 3, HEADS * HN)), (sq, sk)
