"""KL estimators and the KL-coefficient controllers."""

import math

import pytest
import torch

from megatron_rlhf.algo.kl import AdaptiveKLController, FixedKLController, k1, k2, k3, kl_estimate


def test_estimators_values():
    lr = torch.tensor([0.1, -0.05, 0.2, 0.0], dtype=torch.float64)
    assert k1(lr).tolist() == pytest.approx(lr.tolist())
    assert k2(lr).tolist() == pytest.approx([x * x / 2 for x in lr.tolist()])
    assert k3(lr).tolist() == pytest.approx([math.exp(-x) - 1 + x for x in lr.tolist()])
    assert torch.all(k3(torch.linspace(-5, 5, 101)) >= 0)


def test_estimators_agree_in_expectation():
    """Sampling y ~ p, k1 and k3 are unbiased for KL(p || q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    exact = (p * (p / q).log()).sum().item()
    y = torch.multinomial(p, 400_000, replacement=True, generator=g)
    lp, lq = p.log()[y], q.log()[y]
    for name in ("k1", "k3"):
        assert kl_estimate(lp, lq, name).mean().item() == pytest.approx(exact, abs=0.01)
    with pytest.raises(ValueError, match="unknown kl estimator"):
        kl_estimate(lp, lq, "k4")


def test_adaptive_direction_and_bound():
    c = AdaptiveKLController(init_beta=0.1, target=6.0, gain=0.1)
    beta = c.beta
    c.update(9.0)  # above target: beta rises
    assert c.beta > beta and c.beta <= beta * (1 + 0.2 * 0.1) + 1e-12
    assert c.beta == pytest.approx(beta * (1 + 0.1 * 0.2))  # error clipped to +0.2
    beta = c.beta
    c.update(0.0)  # far below: beta falls by exactly 20% x gain
    assert c.beta == pytest.approx(beta * (1 - 0.1 * 0.2))
    beta = c.beta
    c.update(6.6)  # 10% above: not clipped
    assert c.beta == pytest.approx(beta * (1 + 0.1 * 0.1))
    beta = c.beta
    c.update(6.0)  # on target: unchanged
    assert c.beta == beta


@pytest.mark.parametrize("kl", [0.0, 1.0, 5.9, 6.1, 12.0, 1e6])
def test_adaptive_step_is_bounded(kl):
    c = AdaptiveKLController(0.05, target=6.0, gain=0.1)
    c.update(kl)
    ratio = c.beta / 0.05
    assert 1 - 0.02 - 1e-12 <= ratio <= 1 + 0.02 + 1e-12
    assert (ratio > 1) == (kl > 6.0) and (ratio < 1) == (kl < 6.0)


def test_state_round_trip_continues_with_same_beta():
    a = AdaptiveKLController(0.1, target=1.0)
    for kl in [3.0, 2.0, 0.5, 1.7]:
        a.update(kl)
    b = AdaptiveKLController(0.1, target=1.0)
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta
    assert a.update(1.3) == b.update(1.3)
    f = FixedKLController(0.05)
    f.update(100.0)
    g = FixedKLController(0.5)
    g.load_state_dict(f.state_dict())
    assert g.beta == 0.05


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="init_beta"):
        AdaptiveKLController(0.0, 1.0)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0)
    with pytest.raises(ValueError, match="beta"):
        FixedKLController(-1.0)
