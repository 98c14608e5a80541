"""Rollout correction (ppo.rollout_correction): golden weights, the weighted surrogate, the logged fractions."""

import math

import pytest
import torch

from megatron_rlhf.algo.correction import correction_weights
from megatron_rlhf.algo.losses import policy_loss
from megatron_rlhf.config import schema as C
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.trainer.ppo.experience import rollout_stats

# Per-token ratio w = pi_old / sampler: 3, 1, 0.25, 1.5, then padding holding garbage.
SAMPLER = torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.3]], dtype=torch.float64))
TRAINER = torch.log(torch.tensor([[0.3, 0.1, 0.025, 0.15, 1.0]], dtype=torch.float64))
TRAINER[0, 4] = float("inf")
MASK = torch.tensor([[1.0, 1, 1, 1, 0]], dtype=torch.float64)


@pytest.mark.parametrize("mode, weights, capped", [
    ("none", [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]),
    ("tis", [2, 1, 0.25, 1.5, 0], [1, 0, 0, 0, 0]),  # min(w, 2): only w = 3 is truncated
    ("mis", [0, 1, 0, 1.5, 0], [1, 0, 1, 0, 0]),     # outside [1/2, 2]: w = 3 and w = 0.25 are masked
])
def test_golden_weights(mode, weights, capped):
    w, c = correction_weights(TRAINER, SAMPLER, MASK, mode, cap=2.0)
    assert w[0].tolist() == pytest.approx(weights, abs=1e-12)
    assert c.tolist() == [capped]
    assert not w.requires_grad


def test_weights_carry_no_gradient_and_bad_settings_are_refused():
    trainer = TRAINER.clone().requires_grad_(True)
    w, _ = correction_weights(trainer, SAMPLER, MASK, "tis", 2.0)
    assert w.grad_fn is None
    with pytest.raises(ValueError, match="cap=1.0 must be > 1"):
        correction_weights(TRAINER, SAMPLER, MASK, "tis", 1.0)
    with pytest.raises(ValueError, match="'is' is not one of"):
        correction_weights(TRAINER, SAMPLER, MASK, "is", 2.0)


def test_weighted_surrogate_scales_each_token_term():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(2, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    plain, _ = policy_loss(logp, old, adv, mask, 0.2)
    ones, _ = policy_loss(logp, old, adv, mask, 0.2, torch.ones_like(mask))
    assert ones.item() == plain.item()
    weights = torch.tensor([[2.0, 0, 1, 9, 9], [0.5, 1, 1, 1, 0]], dtype=torch.float64)
    weighted, _ = policy_loss(logp, old, adv, mask, 0.2, weights)
    ratio = torch.exp(logp.detach() - old)
    term = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask
    assert weighted.item() == pytest.approx(float((term * weights).sum()), rel=1e-12)
    weighted.backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[1, 4].item() == 0.0  # weight 0: no push on that token


def test_rollout_stats_report_the_capped_fraction():
    gen = {"response_ids": torch.tensor([[5, 6, 7, 8, 0]]), "response_mask": MASK.float(),
           "logprobs": SAMPLER.float(), "ended": torch.tensor([True]), "lengths": torch.tensor([4])}
    exp = build_experience([[1, 2]], gen, pad_id=0)
    exp.logprobs, exp.ref_logprobs = TRAINER.float(), TRAINER.float()
    exp.rm_scores = exp.scores = torch.zeros(1)
    plain = rollout_stats(exp)
    assert not any(k.startswith("correction_") for k in plain)
    tis = rollout_stats(exp, correction=("tis", 2.0))
    assert float(tis["correction_truncated_fraction"]) == pytest.approx(0.25)
    assert float(tis["correction_weight"]) == pytest.approx((2 + 1 + 0.25 + 1.5) / 4, rel=1e-6)
    mis = rollout_stats(exp, correction=("mis", 2.0))
    assert float(mis["correction_masked_fraction"]) == pytest.approx(0.5)
    assert float(mis["correction_weight"]) == pytest.approx(2.5 / 4, rel=1e-6)


@pytest.mark.parametrize("value", ["1.0", "0.5", "inf", "nan"])
def test_cap_is_checked_in_the_config(value):
    base = ["data.train_path=/etc/hosts", "tokenizer.path=/tmp", "model.load=/tmp", "ppo.reward_load=/tmp",
            "data.max_prompt_len=16", "model.max_position_embeddings=128", "ppo.rollout_correction=tis"]
    with pytest.raises(C.ConfigError, match="ppo.rollout_correction_cap=.* must be a finite number > 1") as e:
        C.load_config(C.PPOConfig, None, [*base, f"ppo.rollout_correction_cap={value}"])
    assert "\n" not in str(e.value)
    assert math.isfinite(C.load_config(C.PPOConfig, None, base).ppo.rollout_correction_cap)
