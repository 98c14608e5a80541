"""Shaped token rewards: the KL penalty on every response token, the RM score on the last one.

    r_t = -beta * KL_t                 for every real response token t
    r_T += score                       T = last real token of the row (where the score was read)

Responses that never emitted EOS get a fixed score instead of the RM's (`penalize_missing_eos`),
so that truncation is never rewarded.
"""

from __future__ import annotations

from typing import Union

import torch

from megatron_rlhf.algo.kl import kl_estimate
from megatron_rlhf.algo.masked import zero_padding


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row: mask [B, T] -> [B] (long); 0 for an empty row."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=torch.float32)
    return (mask.to(torch.float32) * positions).argmax(dim=-1)


def penalize_missing_eos(scores: torch.Tensor, ended: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [B] with rows where `ended` [B] (bool: response emitted EOS) is False replaced by `penalty`."""
    return torch.where(ended.bool(), scores, torch.full_like(scores, penalty))


def shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: Union[float, torch.Tensor],
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Per-token rewards [B, T]; 0 on padding.

    scores [B]: sequence score (RM output at EOS, or the missing-EOS penalty).
    logprobs, ref_logprobs [B, T]: log-probs of the sampled tokens under the rollout policy and the
    reference. beta: KL coefficient (float or 0-dim tensor).
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B]={mask.shape[0]} (one per response), got {tuple(scores.shape)}")
    if logprobs.shape != mask.shape or ref_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            f"must match mask {tuple(mask.shape)}"
        )
    kl = kl_estimate(zero_padding(logprobs, mask), zero_padding(ref_logprobs, mask), kl_estimator)
    rewards = -beta * kl * mask
    last = torch.zeros_like(rewards).scatter_(1, last_token_index(mask).unsqueeze(1), 1.0) * mask
    return rewards + scores.unsqueeze(1).to(rewards.dtype) * last
