"""The critic-free advantage estimators of the PPO stage: GRPO, RLOO (group baselines) and ReMax (greedy).

    grpo/rloo  each prompt is sampled `ppo.samples_per_prompt` (k) times; the k responses of a prompt are
               consecutive rows (a group) and are generated on the data-parallel rank that holds the prompt,
               so groups are whole on every rank and in the all-gathered batch (`check_groups_whole`).
               A = algo.advantages.group_advantages(R, k) per sequence.
    remax      one sampled and one greedy response per prompt; A = R - score(greedy response).
R is the sequence reward: the score (RM, or the missing-EOS penalty), minus beta x sum_t KL_t with
`ppo.kl_in=reward` (the sum of PPO's shaped token rewards, gamma = 1); with `kl_in=loss` the KL is a term
of the policy loss instead. The advantage is broadcast over the response's tokens; no value model exists.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_rlhf.algo import masked
from megatron_rlhf.algo.advantages import group_advantages, group_reward_stats
from megatron_rlhf.algo.kl import kl_estimate
from megatron_rlhf.trainer.ppo.batch import Experience


def group_rows(prompt_indices: List[int], k: int) -> List[int]:
    """[n] prompt indices -> [n*k]: each repeated k times in a row (rows g*k .. g*k+k-1 are group g)."""
    return [i for i in prompt_indices for _ in range(k)]


def sequence_rewards(exp: Experience, beta: float, kl_estimator: str, kl_in: str) -> torch.Tensor:
    """[B] scores, minus beta x the response's summed per-token KL estimate when the KL goes in the reward."""
    if kl_in != "reward" or beta == 0:
        return exp.scores
    kl = kl_estimate(exp.logprobs, exp.ref_logprobs, kl_estimator) * exp.response_mask
    return exp.scores - beta * kl.sum(-1)


def estimate_critic_free(exp: Experience, estimator: str, k: int, beta: float, kl_estimator: str, kl_in: str,
                         whiten: bool, baseline: Optional[torch.Tensor] = None, dp_group=None) -> Experience:
    """Phase 4 without a value model: per-sequence advantages [B] broadcast to exp.advantages [B, T].

    `baseline` [B]: ReMax's greedy-response scores (remax only). Groups must be whole on this rank
    (rows in groups of k); whitening, if asked, is global over `dp_group` like GAE's.
    """
    mask = exp.response_mask
    rewards = sequence_rewards(exp, beta, kl_estimator, kl_in)
    if estimator in ("grpo", "rloo"):
        check_groups_whole(exp, k)
        per_sequence = group_advantages(rewards, k, estimator)
    elif estimator == "remax":
        if baseline is None:
            raise ValueError("remax needs the greedy responses' scores as baseline")
        per_sequence = rewards - baseline
    else:
        raise ValueError(f"unknown critic-free estimator {estimator!r}: use grpo, rloo or remax")
    advantages = per_sequence.unsqueeze(1) * mask
    exp.advantages = masked.whiten(advantages, mask, group=dp_group) if whiten else advantages
    return exp


def estimate(exp: Experience, p, beta: float, greedy: Optional[torch.Tensor], dp_group=None) -> Dict[str, torch.Tensor]:
    """Phase 4 for any `ppo.advantage_estimator` (p: the ppo config group); returns the group diagnostics
    (empty for gae). The KL goes into the reward only with ppo.kl_in=reward (else learn.py adds it to the loss)."""
    from megatron_rlhf.trainer.ppo.experience import estimate_advantages

    reward_beta = beta if p.kl_in == "reward" else 0.0
    if p.advantage_estimator == "gae":
        estimate_advantages(exp, reward_beta, p.kl_estimator, p.gamma, p.lam, p.whiten_advantages, dp_group)
        return {}
    estimate_critic_free(exp, p.advantage_estimator, p.samples_per_prompt, reward_beta, p.kl_estimator, p.kl_in,
                         p.whiten_advantages, greedy, dp_group)
    return group_stats(exp.scores, p.samples_per_prompt, greedy, dp_group)


def remax_baseline(engine, prompt_rows: List[List[int]], tokenizer, reward_chunks, frozen, cfg) -> Optional[torch.Tensor]:
    """ReMax: [B] scores (RM, or the missing-EOS penalty) of one greedy response per prompt of this rank;
    None for the other estimators."""
    from megatron_rlhf.rollout.base import SamplingParams
    from megatron_rlhf.trainer.ppo.experience import score_responses
    from megatron_rlhf.trainer.ppo.eval import generate

    p = cfg.ppo
    if p.advantage_estimator != "remax":
        return None
    exp = generate(engine, prompt_rows, tokenizer, SamplingParams(p.max_new_tokens, p.temperature, greedy=True), None)
    return score_responses(reward_chunks, exp.microbatches(cfg.train.micro_batch_size), frozen)[1]


def check_groups_whole(exp: Experience, k: int) -> None:
    """Raise unless every k consecutive rows share one prompt (a group split over ranks would not)."""
    if exp.size % k:
        raise RuntimeError(f"{exp.size} rollouts do not form whole groups of ppo.samples_per_prompt={k}")
    width = int(exp.prompt_lengths.max())
    cols = torch.arange(width).unsqueeze(0)
    prompts = torch.where(cols < exp.prompt_lengths.unsqueeze(1), exp.input_ids[:, :width], -1).view(-1, k, width)
    same = (prompts == prompts[:, :1]).all(-1).all(-1)
    if not bool(same.all()):
        g = int((~same).nonzero()[0])
        raise RuntimeError(f"group {g} (rows {g * k}..{g * k + k - 1}) mixes prompts: its responses were not sampled "
                           "together; groups must stay whole on one data-parallel rank")


def group_stats(scores: torch.Tensor, k: int, baseline: Optional[torch.Tensor] = None,
                dp_group=None) -> Dict[str, torch.Tensor]:
    """Global means over groups: group_flat_fraction (all scores equal: zero advantage) and
    group_reward_std (within-group std). ReMax's group is the pair (sampled, greedy)."""
    if baseline is not None:
        scores, k = torch.stack([scores, baseline], 1).reshape(-1), 2
    flat, std = group_reward_stats(scores, k)
    ones = torch.ones_like(flat)
    return {"group_flat_fraction": masked.masked_mean(flat, ones, dp_group),
            "group_reward_std": masked.masked_mean(std, ones, dp_group)}
