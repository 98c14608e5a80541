"""Masked statistics on one rank (the multi-rank case is tests/distributed/test_algo_distributed.py)."""

import math

import pytest
import torch

from megatron_rlhf.algo.masked import masked_mean, masked_sum, masked_var, whiten


def _ragged(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64) * 3 + 1
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    return x, mask


def test_stats_equal_those_of_the_real_tokens():
    x, mask = _ragged()
    real = x[mask.bool()]
    assert masked_sum(x, mask).item() == pytest.approx(real.sum().item())
    assert masked_mean(x, mask).item() == pytest.approx(real.mean().item())
    assert masked_var(x, mask).item() == pytest.approx(real.var().item())  # unbiased
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(real.var(unbiased=False).item())
    per_row = masked_mean(x, mask, dim=1)
    for b in range(x.shape[0]):
        assert per_row[b].item() == pytest.approx(x[b][mask[b].bool()].mean().item())


def test_whiten_zero_mean_unit_var_and_zero_padding():
    x, mask = _ragged(1)
    w = whiten(x, mask)
    real = w[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert real.var().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(w[~mask.bool()] == 0)
    kept = whiten(x, mask, shift_mean=False)
    assert kept[mask.bool()].mean().item() == pytest.approx(masked_mean(x, mask).item())


def test_padding_garbage_is_ignored():
    x, mask = _ragged(2)
    dirty = x.clone()
    dirty[~mask.bool()] = math.nan
    dirty[0, -1] = math.inf if mask[0, -1] == 0 else dirty[0, -1]
    for fn in (masked_sum, masked_mean, masked_var):
        assert torch.equal(fn(x, mask), fn(dirty, mask))
    assert torch.equal(whiten(x, mask), whiten(dirty, mask))


def test_gradient_of_masked_mean():
    x, mask = _ragged(3)
    x.requires_grad_(True)
    masked_mean(x, mask).backward()
    assert torch.allclose(x.grad, mask / mask.sum())


def test_empty_mask_gives_zero_not_nan():
    x = torch.randn(2, 3)
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0


def test_shape_mismatch_is_one_clear_error():
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="dim=None"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 3), group=object(), dim=1)
