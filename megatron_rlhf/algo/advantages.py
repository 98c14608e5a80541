"""Advantages: GAE over response tokens, and the group baselines of the value-free siblings.

GAE (Schulman et al. 2015), backwards over the real tokens of each row:
    delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last real token = 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                          (the value target)
Advantages are returned NOT whitened (see `masked.whiten`, global over DP ranks).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_rlhf.algo.masked import zero_padding


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 on padding; vectorised over the batch.

    rewards, values, mask: [B, T], right-padded. Padding values are ignored (zeroed first), so
    whatever sits there (even inf/NaN) cannot leak into real tokens.
    """
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)} "
            "must all be [B, T]"
        )
    rewards = zero_padding(rewards, mask)
    values = zero_padding(values, mask)
    T = rewards.shape[1]
    if T == 0:
        return rewards.clone(), rewards.clone()
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = [None] * T
    for t in reversed(range(T)):
        # On padding mask=0: delta and A are 0, and V_{t+1}=0 for the last real token.
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t]
        advantages[t] = next_advantage
    advantages = torch.stack(advantages, dim=1)
    returns = (advantages + values) * mask
    return advantages, returns


def group_advantages(scores: torch.Tensor, group_size: int, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages [N] from a group baseline; scores [N] = consecutive groups of `group_size`
    samples of the same prompt.

    grpo: (s - mean_group) / (std_group + eps)      (Shao et al. 2024; unbiased std)
    rloo: s - mean of the other k-1 samples         (Ahmadian et al. 2024)
    The caller broadcasts them over each response's tokens.
    """
    if scores.dim() != 1:
        raise ValueError(f"group_advantages: scores must be [N], got {tuple(scores.shape)}")
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(
            f"group_advantages: {scores.shape[0]} scores cannot be split into groups of "
            f"group_size={group_size} (need >= 2 and a divisor of the number of scores)"
        )
    groups = scores.view(-1, group_size)
    if kind == "grpo":
        out = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)
    elif kind == "rloo":
        others_mean = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
        out = groups - others_mean
    else:
        raise ValueError(f"group_advantages: unknown kind {kind!r}: use 'grpo' or 'rloo'")
    return out.reshape(-1)


def group_reward_stats(scores: torch.Tensor, group_size: int, tol: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flat [G] float: 1.0 where a group's scores are all equal within `tol`, std [G]: the unbiased
    within-group std); scores [N] = consecutive groups of `group_size`. A flat group has zero advantage
    under a group baseline: it carries no learning signal."""
    groups = scores.view(-1, group_size)
    flat = (groups.max(1).values - groups.min(1).values <= tol).to(scores.dtype)
    return flat, groups.std(1)
