"""models/rope.py: the RoPE that replaces Megatron's unfused one equals it bit for bit, forward and backward."""

import pytest
import torch

from megatron_rlhf.models import rope


def _megatron_rope():
    from megatron.core.models.common.embeddings import rope_utils

    rope.install()
    return rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_bshd.megatron


def _freqs(s, d, interleaved=False):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.stack((f, f), -1).flatten(-2) if interleaved else torch.cat((f, f), -1)
    return emb[:, None, None, :]  # [s, 1, 1, d], as Megatron's RotaryEmbedding returns it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_megatron_forward_and_backward(dtype):
    ours, megatron = _megatron_rope()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 2, 3, 3 * 16, generator=g).to(dtype)
    t = qkv[..., :16]  # a strided view, as Megatron's split of the fused qkv gives it
    freqs, grad = _freqs(7, 16), torch.randn(7, 2, 3, 16, generator=g).to(dtype)
    results = []
    for fn in (ours, megatron):
        x = t.clone().requires_grad_()
        y = fn(x, freqs)
        y.backward(grad)
        results.append((y.detach(), x.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_other_cases_take_megatrons_path():
    ours, megatron = _megatron_rope()
    t = torch.randn(5, 1, 2, 8)
    for freqs, kwargs in ((_freqs(5, 8, interleaved=True), {"rotary_interleaved": True}),
                          (_freqs(5, 4), {}),  # rotation over part of the head
                          (_freqs(5, 8), {"mscale": 0.5})):
        assert torch.equal(ours(t, freqs, **kwargs), megatron(t, freqs, **kwargs))


def test_the_angles_are_computed_once_per_freqs_tensor(monkeypatch):
    ours, megatron = _megatron_rope()
    freqs, other, t = _freqs(6, 8), _freqs(6, 8) * 2, torch.randn(6, 1, 2, 8)
    expected = {id(f): megatron(t, f) for f in (freqs, other)}
    calls = []
    cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: calls.append(x.shape) or cos(x))
    for _ in range(3):  # the layers of one forward, queries and keys
        assert torch.equal(ours(t, freqs), expected[id(freqs)])
    assert len(calls) == 1
    assert torch.equal(ours(t, other), expected[id(other)])  # new angles (another length or offset): recomputed
    assert len(calls) == 2
    with torch.inference_mode():  # inference tensors are kept apart from autograd's
        ours(t, other)
    x = t.clone().requires_grad_()
    ours(x, other).sum().backward()
    assert x.grad is not None and len(calls) == 4
