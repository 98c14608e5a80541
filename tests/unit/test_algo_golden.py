"""The golden values of shared/reference/ppo-spec.md: the four-token example and the four clipping cases."""

import pytest
import torch

from megatron_rlhf.algo.advantages import gae
from megatron_rlhf.algo.losses import policy_loss
from megatron_rlhf.algo.rewards import shaped_rewards

BETA, GAMMA, LAM = 0.1, 1.0, 0.95
LOG_RATIOS = [0.10, -0.05, 0.20, 0.00]
VALUES = [0.5, 0.6, 0.4, 0.8]
SCORE = 1.0
TOL = 1e-3


def _example(pad: int = 0, pad_value: float = 0.0):
    """The spec's example as a batch of one row, right-padded with `pad` tokens holding `pad_value`."""
    T = 4 + pad
    ref = torch.full((1, T), pad_value, dtype=torch.float64)
    ref[0, :4] = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)  # arbitrary reference logprobs
    logprobs = torch.full((1, T), pad_value, dtype=torch.float64)
    logprobs[0, :4] = ref[0, :4] + torch.tensor(LOG_RATIOS, dtype=torch.float64)
    values = torch.full((1, T), pad_value, dtype=torch.float64)
    values[0, :4] = torch.tensor(VALUES, dtype=torch.float64)
    mask = torch.zeros((1, T), dtype=torch.float64)
    mask[0, :4] = 1.0
    return torch.tensor([SCORE], dtype=torch.float64), logprobs, ref, values, mask


@pytest.mark.parametrize("pad,pad_value", [(0, 0.0), (3, 7.5), (2, -100.0)])
def test_shaped_rewards_and_advantages(pad, pad_value):
    scores, logprobs, ref, values, mask = _example(pad, pad_value)
    rewards = shaped_rewards(scores, logprobs, ref, mask, BETA)
    expected_rewards = [-0.010, 0.005, -0.020, 1.000]
    assert torch.allclose(rewards[0, :4], torch.tensor(expected_rewards, dtype=torch.float64), atol=TOL)
    assert torch.all(rewards[0, 4:] == 0)

    # TD errors follow from the definition with V after the last token = 0.
    v = values[0, :4]
    next_v = torch.cat([v[1:], torch.zeros(1, dtype=v.dtype)])
    deltas = rewards[0, :4] + GAMMA * next_v - v
    assert torch.allclose(deltas, torch.tensor([0.090, -0.195, 0.380, 0.200], dtype=torch.float64), atol=TOL)

    advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
    expected_adv = torch.tensor([0.419, 0.347, 0.570, 0.200], dtype=torch.float64)
    assert torch.allclose(advantages[0, :4], expected_adv, atol=TOL)
    assert advantages[0, 1].item() == pytest.approx(0.3465, abs=1e-9)
    assert torch.allclose(returns[0, :4], advantages[0, :4] + v)
    assert torch.all(advantages[0, 4:] == 0) and torch.all(returns[0, 4:] == 0)


# (A, rho, objective, gradient flows)
CLIP_CASES = [
    (2.0, 1.3, 2.4, False),
    (2.0, 0.7, 1.4, True),
    (-2.0, 1.3, -2.6, True),
    (-2.0, 0.7, -1.6, False),
]


@pytest.mark.parametrize("adv,rho,objective,grad_flows", CLIP_CASES)
def test_clipping_cases(adv, rho, objective, grad_flows):
    old = torch.tensor([[-1.2]], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor(rho, dtype=torch.float64))).requires_grad_(True)
    A = torch.tensor([[adv]], dtype=torch.float64)
    mask = torch.ones((1, 1), dtype=torch.float64)
    loss, stats = policy_loss(logp, old, A, mask, clip_eps=0.2)
    assert -loss.item() == pytest.approx(objective, abs=1e-9)
    assert stats["clipfrac"].item() == (0.0 if grad_flows else 1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    if grad_flows:
        # d(-rho*A)/d logp = -rho*A
        assert grad.item() == pytest.approx(-rho * adv, abs=1e-9)
    else:
        assert grad.item() == 0.0


def test_clipping_cases_batched_match_single():
    """All four cases in one batch: the token sum is the sum of the four objectives, gradients per token."""
    adv = torch.tensor([[c[0] for c in CLIP_CASES]], dtype=torch.float64)
    rho = torch.tensor([[c[1] for c in CLIP_CASES]], dtype=torch.float64)
    old = torch.zeros_like(rho)
    logp = torch.log(rho).requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, torch.ones_like(rho))
    assert -loss.item() == pytest.approx(sum(c[2] for c in CLIP_CASES), abs=1e-9)
    assert stats["clipfrac"].item() == 2.0 and stats["tokens"].item() == 4.0
    (grad,) = torch.autograd.grad(loss, logp)
    flows = torch.tensor([c[3] for c in CLIP_CASES])
    assert torch.all((grad[0] != 0) == flows)
