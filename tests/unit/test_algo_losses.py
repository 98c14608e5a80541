"""Value loss, policy-loss statistics, shaped-reward variants, Bradley-Terry and DPO."""

import math

import pytest
import torch

from megatron_rlhf.algo.losses import bradley_terry, dpo_loss, entropy_bonus, policy_loss, value_loss
from megatron_rlhf.algo.rewards import last_token_index, penalize_missing_eos, shaped_rewards


def _batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    t = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    lengths = torch.tensor([6, 3, 1, 4])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    return t, mask


def test_value_loss_cases():
    # (V, V_old, R): unclipped wins / clipped wins / inside the clip range.
    V = torch.tensor([[1.0, 0.0, 0.1]], dtype=torch.float64, requires_grad=True)
    V_old = torch.tensor([[0.0, 0.5, 0.0]], dtype=torch.float64)
    R = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(V_old)
    loss, stats = value_loss(V, V_old, R, mask, clip_eps=0.2)
    # token 0: unclipped (1-2)^2=1, clipped (0.2-2)^2=3.24 -> 1.62, clipped term wins, no grad
    # token 1: unclipped (0-1)^2=1, clipped (0.3-1)^2=0.49 -> 0.5, grad flows
    # token 2: inside the range, both equal 0.01 -> 0.005
    assert loss.item() == pytest.approx(1.62 + 0.5 + 0.005)
    assert stats["vf_clipfrac"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, V)
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(0.0 - 1.0)
    assert grad[0, 2].item() == pytest.approx(0.1)


def test_losses_are_token_sums_and_ignore_padding():
    t, mask = _batch()
    logp, old, adv = t() * 0.1 - 2, t() * 0.1 - 2, t()
    loss, stats = policy_loss(logp, old, adv, mask)
    # Token sum: equals the sum of per-row losses computed on real tokens only.
    rows = sum(policy_loss(logp[b : b + 1], old[b : b + 1], adv[b : b + 1], mask[b : b + 1])[0] for b in range(4))
    assert loss.item() == pytest.approx(rows.item())
    assert stats["tokens"].item() == mask.sum().item()
    assert stats["ratio"].item() == pytest.approx(torch.exp(logp - old)[mask.bool()].sum().item())
    assert stats["approx_kl"].item() == pytest.approx((0.5 * (logp - old) ** 2)[mask.bool()].sum().item())

    dirty_logp = logp.clone().requires_grad_(True)
    with torch.no_grad():
        dirty_logp[~mask.bool()] = math.inf
    dirty_old = old.clone()
    dirty_old[~mask.bool()] = -math.inf
    dirty_adv = adv.clone()
    dirty_adv[~mask.bool()] = math.nan
    dirty_loss, dirty_stats = policy_loss(dirty_logp, dirty_old, dirty_adv, mask)
    assert dirty_loss.item() == pytest.approx(loss.item())
    assert all(dirty_stats[k].item() == pytest.approx(stats[k].item()) for k in stats)
    (grad,) = torch.autograd.grad(dirty_loss, dirty_logp)
    assert torch.isfinite(grad).all() and torch.all(grad[~mask.bool()] == 0)

    V, V_old, R = t(), t(), t()
    vl, _ = value_loss(V, V_old, R, mask)
    V2 = V.clone()
    V2[~mask.bool()] = math.nan
    assert value_loss(V2, V_old, R, mask)[0].item() == pytest.approx(vl.item())


def test_policy_loss_stats_are_detached():
    t, mask = _batch(1)
    logp = (t() * 0.1).requires_grad_(True)
    _, stats = policy_loss(logp, t() * 0.1, t(), mask)
    assert all(not v.requires_grad for v in stats.values())


def test_entropy_bonus():
    H = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = entropy_bonus(H, mask)
    assert loss.item() == -3.0 and stats["entropy"].item() == 3.0


def test_shaped_rewards_estimators_and_ragged_rows():
    t, mask = _batch(2)
    logp, ref = t() - 2, t() - 2
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    assert last_token_index(mask).tolist() == [5, 2, 0, 3]
    for est, fn in [("k1", lambda r: r), ("k2", lambda r: 0.5 * r**2), ("k3", lambda r: torch.exp(-r) - 1 + r)]:
        r = shaped_rewards(scores, logp, ref, mask, beta=0.3, kl_estimator=est)
        expected = -0.3 * fn(logp - ref) * mask
        for b, last in enumerate([5, 2, 0, 3]):
            expected[b, last] += scores[b]
        assert torch.allclose(r, expected)
    # A tensor beta works the same as a float one.
    assert torch.allclose(
        shaped_rewards(scores, logp, ref, mask, torch.tensor(0.3, dtype=torch.float64)),
        shaped_rewards(scores, logp, ref, mask, 0.3),
    )
    with pytest.raises(ValueError, match="scores must be"):
        shaped_rewards(scores[:2], logp, ref, mask, 0.1)


def test_penalize_missing_eos():
    scores = torch.tensor([1.0, 2.0, 3.0])
    out = penalize_missing_eos(scores, torch.tensor([True, False, True]), penalty=-5.0)
    assert out.tolist() == [1.0, -5.0, 3.0]


def test_bradley_terry():
    chosen = torch.tensor([2.0, 0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.0])
    loss, acc = bradley_terry(chosen, rejected)
    expected = sum(math.log1p(math.exp(-(c - r))) for c, r in [(2, 1), (0, 1), (1, 1)]) / 3
    assert loss.item() == pytest.approx(expected)
    assert acc.item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.all(chosen.grad < 0)  # raising the chosen score lowers the loss


def test_dpo_loss():
    pw, pl = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0])
    rw, rl = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -4.5])
    loss, stats = dpo_loss(pw, pl, rw, rl, beta=0.5)
    margins = [0.5 * ((-3.0 + 3.5) - (-4.0 + 3.5)), 0.5 * ((-5.0 + 5.0) - (-4.0 + 4.5))]
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 2)
    assert stats["accuracy"].item() == 0.5
