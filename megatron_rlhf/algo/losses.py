"""Losses: clipped PPO policy and value losses, entropy bonus, Bradley-Terry, DPO.

Token losses return (token SUM, stats): the trainer divides by the number of response tokens
all-reduced over data-parallel ranks, so the update does not depend on DP size or micro-batching.
Stats are detached masked SUMS too (divide by `stats["tokens"]`, summed the same way, for means).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_rlhf.algo.kl import kl_estimate
from megatron_rlhf.algo.masked import zero_padding

Stats = Dict[str, torch.Tensor]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate, as a loss to minimise: sum_t -min(rho*A, clip(rho, 1-eps, 1+eps)*A).

    logprobs [B, T] (current policy, carries gradient), old_logprobs [B, T] (rollout policy),
    advantages [B, T] (whitened), mask [B, T]; weights [B, T] (detached; `correction.correction_weights`)
    scale each token's term, None = 1. Where the clipped term wins, the gradient is zero:
    the update stops pushing rho further out of [1-eps, 1+eps] in the direction A favours.
    stats (sums over real tokens): clipfrac (tokens where clipping was active), approx_kl
    (0.5 * (logp - logp_old)^2), ratio (rho; its mean should be 1.0 on the first minibatch), tokens.
    """
    # Zero the padding first: garbage there (even inf) must not reach the sum or the gradient.
    logprobs, old_logprobs = zero_padding(logprobs, mask), zero_padding(old_logprobs, mask)
    advantages = zero_padding(advantages, mask)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    # max of the negated terms == -min of the objectives.
    token_loss = torch.maximum(unclipped, clipped) * mask
    loss_sum = (token_loss if weights is None else token_loss * weights).sum()
    with torch.no_grad():
        stats = {
            "clipfrac": ((clipped > unclipped).to(mask.dtype) * mask).sum(),
            "approx_kl": (0.5 * log_ratio**2 * mask).sum(),
            "ratio": (ratio * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss_sum, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> Tuple[torch.Tensor, Stats]:
    """Clipped value loss: sum_t 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).

    values [B, T] (current value model, carries gradient), old_values [B, T] (at rollout),
    returns [B, T] (GAE targets). stats (sums): vf_clipfrac (tokens where the clipped term was
    larger), tokens.
    """
    values, old_values, returns = (zero_padding(t, mask) for t in (values, old_values, returns))
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    err_unclipped = (values - returns) ** 2
    err_clipped = (values_clipped - returns) ** 2
    loss_sum = (0.5 * torch.maximum(err_unclipped, err_clipped) * mask).sum()
    with torch.no_grad():
        stats = {
            "vf_clipfrac": ((err_clipped > err_unclipped).to(mask.dtype) * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss_sum, stats


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> Tuple[torch.Tensor, Stats]:
    """GRPO's KL term for the policy loss: sum_t KL_t (estimator k1/k2/k3 of logp - logp_ref), to be scaled by beta.

    logprobs [B, T] (current policy, carries gradient), ref_logprobs [B, T] (frozen reference), mask [B, T].
    k3 = exp(-r) - 1 + r (r = logp - logp_ref) has gradient (1 - exp(-r)) dlogp: zero where the policy
    equals the reference, pulling it back otherwise. stats (sums): kl_loss_term, tokens.
    """
    logprobs, ref_logprobs = zero_padding(logprobs, mask), zero_padding(ref_logprobs, mask)
    total = (kl_estimate(logprobs, ref_logprobs, estimator) * mask).sum()
    return total, {"kl_loss_term": total.detach(), "tokens": mask.sum()}


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, Stats]:
    """-sum_t H_t (minimising it raises entropy; scale by a small coefficient). entropy [B, T]."""
    total = zero_padding(entropy, mask).sum()
    return -total, {"entropy": total.detach(), "tokens": mask.sum()}


def bradley_terry(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reward-model loss on preference pairs: (mean -logsigmoid(s_w - s_l), pairwise accuracy).

    chosen_scores, rejected_scores: [N] scalar scores of the preferred and the other response.
    accuracy is the detached fraction of pairs with s_w > s_l (ties count as wrong).
    """
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"bradley_terry: chosen {tuple(chosen_scores.shape)} and rejected "
            f"{tuple(rejected_scores.shape)} scores must pair up"
        )
    margin = chosen_scores - rejected_scores
    loss = -F.logsigmoid(margin).mean()
    accuracy = (margin.detach() > 0).to(margin.dtype).mean()
    return loss, accuracy


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Tuple[torch.Tensor, Stats]:
    """DPO (Rafailov et al. 2023): mean -logsigmoid(beta * ((lp_w - lpref_w) - (lp_l - lpref_l))).

    All inputs [N]: summed log-probs of each full response. `label_smoothing` eps assumes each label
    is flipped with probability eps (conservative DPO): the loss per pair becomes
    -(1 - eps) * logsigmoid(h) - eps * logsigmoid(-h), h the margin of implicit rewards.
    stats (detached means): chosen_reward, rejected_reward (the implicit rewards beta * log-ratio),
    accuracy (chosen_reward > rejected_reward).
    """
    chosen = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected = beta * (policy_rejected_logps - ref_rejected_logps)
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-margin).mean()
    with torch.no_grad():
        stats = {
            "chosen_reward": chosen.mean(),
            "rejected_reward": rejected.mean(),
            "accuracy": (chosen > rejected).to(chosen.dtype).mean(),
        }
    return loss, stats
