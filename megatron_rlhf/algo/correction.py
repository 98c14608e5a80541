"""Rollout correction: token weights for the gap between the sampler and the trainer.

The generation engine (vLLM, a bf16 copy, a truncated top-k/top-p sampler) draws tokens from a
distribution mu that is not exactly the trainer's pi_old. PPO's ratio pi_theta / pi_old is taken
against the trainer's recomputation, so the samples are off-policy by w_t = pi_old(y_t) / mu(y_t)
(`rho` in the diagnostics). Two corrections, both at the token level, both detached weights on the
policy loss (Yao et al. 2025, "truncated importance sampling"; the "mask" variant as in verl):

    none  w~_t = 1
    tis   w~_t = min(w_t, C)                          truncated importance sampling
    mis   w~_t = w_t if 1/C <= w_t <= C, else 0       masked importance sampling: outliers dropped

Shapes: [B, T] over response tokens, right-padded; `mask` 1.0 on real tokens.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_rlhf.algo.masked import zero_padding

MODES = ("none", "tis", "mis")


def correction_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], capped [B, T]) for the policy loss; both 0 on padding, no gradient.

    trainer_logprobs [B, T]: log pi_old, the trainer's recomputation; sampler_logprobs [B, T]: log mu, what
    the engine reported; cap C > 1. capped is 1.0 on the tokens the cap changed: w_t > C under tis (truncated),
    w_t outside [1/C, C] under mis (masked); all 0 under none.
    """
    if mode not in MODES:
        raise ValueError(f"rollout correction mode {mode!r} is not one of {MODES}")
    if not cap > 1.0:
        raise ValueError(f"rollout correction cap={cap} must be > 1")
    with torch.no_grad():
        dtype = torch.promote_types(trainer_logprobs.dtype, torch.float32)  # bf16 log-probs: ratios in fp32
        log_w = zero_padding(trainer_logprobs.to(dtype) - sampler_logprobs.to(dtype), mask)
        w = torch.exp(log_w)
        if mode == "none":
            weights, capped = torch.ones_like(w), torch.zeros_like(w)
        elif mode == "tis":
            capped = (w > cap).to(w.dtype)
            weights = torch.clamp(w, max=cap)
        else:
            capped = ((w > cap) | (w < 1.0 / cap)).to(w.dtype)
            weights = w * (1.0 - capped)
    return weights * mask, capped * mask
