"""Phase 5 of a PPO iteration: `ppo.epochs` passes over shuffled minibatches of the rollout batch.

Each minibatch is one optimizer step of the policy (clipped surrogate, optional entropy bonus, the KL
term with ppo.kl_in=loss, PPO-ptx micro-batches with ppo.ptx_coef) and one of the value model (clipped
value loss x vf_coef; none for the critic-free estimators), each through Megatron's schedule with token-sum
losses divided once by the global token count (trainer/optim.py). Minibatches are cut from the GLOBAL
rollout batch (every rank holds it, `batch.all_gather_experience`) with a permutation seeded by
(seed, iteration): the same rollouts meet in the same minibatch whatever the data-parallel size, and a
resumed run repeats the same order. Each rank trains its contiguous share of every minibatch.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_rlhf.data.sampler import balanced_share
from megatron_rlhf.models import packing
from megatron_rlhf.algo.correction import correction_weights
from megatron_rlhf.algo.losses import entropy_bonus, kl_penalty, policy_loss, value_loss
from megatron_rlhf.trainer.ppo.batch import Experience
from megatron_rlhf.trainer.ppo.experience import (response_entropy, response_logprobs, response_logprobs_and_entropy,
                                                  response_rows, response_values)
from megatron_rlhf.trainer.ppo.ptx import PtxBatches, ptx_loss, with_scale
from megatron_rlhf.trainer.run import Trainable
from megatron_rlhf.trainer.step import make_forward_step, train_step

NAN_HOOK = "MEGATRON_RLHF_INJECT_NAN"  # test hook: "policy:3,4" poisons the policy loss at those optimizer steps


class TrainingDiverged(RuntimeError):
    """Too many optimizer steps in a row had NaN/Inf gradients."""


POLICY_STATS = ("policy_loss", "clip_fraction", "approx_kl", "ratio", "entropy")


def policy_loss_fn(vocab_size: int, temperature: float, clip_eps: float, entropy_coef: float, poison: dict,
                   kl_coef: float = 0.0, kl_estimator: str = "k3", ptx: bool = False,
                   correction: Tuple[str, float] = ("none", 2.0)):
    """loss_fn(logits, mb) -> (token-sum loss, tokens, stats) for `make_forward_step`: logits [b, T, V/tp] at
    the response rows (`rows=response_rows`) or [b, S, V/tp] (PPO-ptx micro-batches, and callers without rows).

    correction (ppo.rollout_correction, its cap): each token's surrogate term weighted by
    algo.correction's weight of pi_old (mb["logprobs"]) against the sampler (mb["sampler_logprobs"]).
    kl_coef > 0 (ppo.kl_in=loss): + kl_coef x sum_t KL_t(policy || reference) (algo.losses.kl_penalty).
    ptx: the step also runs PPO-ptx micro-batches (they carry "labels"; trainer/ppo/ptx.py); every micro-batch
    then reports every stat name (zeros for the other kind), as `reduce_stats` needs."""
    names = POLICY_STATS + (("kl_loss_term",) if kl_coef > 0 else ()) + (("ptx_loss",) if ptx else ())

    def loss_fn(logits, mb):
        if "labels" in mb:
            loss_sum, n, stats = ptx_loss(logits, mb, vocab_size)
        else:
            loss_sum, n, stats = ppo_policy_loss(logits, mb)
        zero = (torch.zeros(()), torch.zeros(()))
        return loss_sum, n, {k: stats.get(k, zero) for k in names}

    def ppo_policy_loss(logits, mb):
        mask = mb["response_mask"]
        if entropy_coef > 0:  # the entropy is trained: its own differentiable pass
            logp = response_logprobs(logits, mb, vocab_size, temperature)
            entropy = response_entropy(logits, mb, vocab_size, temperature)
        else:  # a diagnostic only: from the log-probs' softmax, no graph, no backward cost
            logp, entropy = response_logprobs_and_entropy(logits, mb, vocab_size, temperature)
        weights = None
        if correction[0] != "none":
            weights, _ = correction_weights(mb["logprobs"], mb["sampler_logprobs"], mask, *correction)
        loss_sum, s = policy_loss(logp, mb["logprobs"], mb["advantages"], mask, clip_eps, weights)
        stats = {}
        if kl_coef > 0:
            kl_sum, k = kl_penalty(logp, mb["ref_logprobs"], mask, kl_estimator)
            loss_sum = loss_sum + kl_coef * kl_sum
            stats["kl_loss_term"] = (k["kl_loss_term"], s["tokens"])
        if entropy_coef > 0:
            bonus, _ = entropy_bonus(entropy, mask)
            loss_sum = loss_sum + entropy_coef * bonus
        if poison.get("now"):
            loss_sum = loss_sum * float("nan")
        n = s["tokens"]
        return loss_sum, n, {
            **stats, "policy_loss": (loss_sum.detach(), n), "clip_fraction": (s["clipfrac"], n),
            "approx_kl": (s["approx_kl"], n), "ratio": (s["ratio"], n),
            "entropy": ((entropy.detach() * mask).sum(), n),
        }

    return loss_fn


def value_loss_fn(clip_eps: float, vf_coef: float):
    """loss_fn(values [b, S, 1], mb) -> (vf_coef x token-sum clipped value loss, tokens, stats)."""

    def loss_fn(output, mb):
        mask = mb["response_mask"]
        loss_sum, s = value_loss(response_values(output, mb), mb["values"], mb["returns"], mask, clip_eps)
        n = s["tokens"]
        return vf_coef * loss_sum, n, {"value_loss": (loss_sum.detach(), n), "value_clip_fraction": (s["vf_clipfrac"], n)}

    return loss_fn


def _poisoned_steps() -> Dict[str, set]:
    spec = os.environ.get(NAN_HOOK, "")
    out: Dict[str, set] = defaultdict(set)
    for part in filter(None, spec.split(";")):
        name, _, steps = part.partition(":")
        out[name] = {int(x) for x in steps.split(",") if x}
    return out


class SkipGuard:
    """Counts each model's optimizer steps skipped for NaN/Inf in a row; raises `TrainingDiverged` at the limit."""

    def __init__(self, limit: int, log: Optional[Callable[[str], None]] = None):
        self.limit, self.log = limit, log
        self.in_a_row: Dict[str, int] = defaultdict(int)

    def record(self, model: str, step: int, stats: Dict[str, float]) -> None:
        if not stats.get("skipped"):
            self.in_a_row[model] = 0
            return
        self.in_a_row[model] += 1
        n = self.in_a_row[model]
        if self.log:
            self.log(f"warning: {model} step {step}: NaN/Inf in the loss or gradients; step skipped "
                     f"({n} in a row, limit ppo.max_consecutive_skips={self.limit})")
        if n >= self.limit:
            raise TrainingDiverged(
                f"{n} {model} optimizer steps in a row had NaN/Inf gradients (the last at step {step}): stopped; "
                "the last good checkpoint is intact. Lower train.lr / ppo.value_lr, check the reward scale, then resume")


def learn(policy: Trainable, value: Optional[Trainable], exp: Experience, cfg, *, iteration: int, dp_rank: int,
          dp_size: int, vocab_size: int, train_policy: bool, guard: SkipGuard, steps_done: Dict[str, int],
          beta: float = 0.0, ptx: Optional[PtxBatches] = None) -> Dict[str, float]:
    """Run the PPO epochs on the global rollout batch `exp`; returns iteration means of the step stats.

    `value` None: the critic-free estimators (no value step). `beta`: the KL coefficient, used here only
    with ppo.kl_in=loss. `ptx`: PPO-ptx batches (ppo.ptx_coef > 0), one per policy step.
    `steps_done` ({"policy": n, "value": n}) counts optimizer steps so far (for the NaN test hook) and is
    advanced here. Stats: policy_loss, clip_fraction, approx_kl, ratio, entropy, policy_grad_norm,
    value_loss, value_clip_fraction, value_grad_norm, ratio_first_minibatch, skipped_steps, and
    kl_loss_term (kl_in=loss), ptx_loss (PPO-ptx).
    """
    p = cfg.ppo
    poison, poisoned = {}, _poisoned_steps()
    kl_coef = beta if p.kl_in == "loss" else 0.0
    policy_step = make_forward_step(policy_loss_fn(vocab_size, p.temperature, p.clip_eps, p.entropy_coef, poison,
                                                   kl_coef, p.kl_estimator, ptx is not None,
                                                   (p.rollout_correction, p.rollout_correction_cap)),
                                    rows=response_rows)
    value_step = make_forward_step(value_loss_fn(p.value_clip_eps, p.vf_coef))
    generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + iteration)
    share = p.minibatch_size // dp_size
    history: Dict[str, List[float]] = defaultdict(list)
    first_ratio = None
    for _epoch in range(p.epochs):
        order = torch.randperm(exp.size, generator=generator)
        for start in range(0, exp.size, p.minibatch_size):
            mine = order[start + dp_rank * share: start + (dp_rank + 1) * share]
            if packing.enabled() and dp_size > 1:  # an equal number of rows, their tokens balanced over DP ranks
                rows = order[start: start + p.minibatch_size]
                mine = rows[balanced_share(exp.sequence_lengths[rows].tolist(), dp_rank, dp_size)]
            mbs = exp.rows(mine).microbatches(cfg.train.micro_batch_size,
                                              max_tokens=cfg.train.max_tokens_per_micro_batch)
            if train_policy:
                steps_done["policy"] += 1
                poison["now"] = steps_done["policy"] in poisoned.get("policy", ())
                policy_mbs = mbs
                if ptx is not None:  # the whole minibatch's tokens: every rank holds the global batch
                    ptx_mbs, ptx_tokens = ptx.next_share()
                    policy_tokens = float(exp.response_mask[order[start:start + p.minibatch_size]].sum())
                    policy_mbs = mbs + with_scale(ptx_mbs, p.ptx_coef, policy_tokens, ptx_tokens)
                s = train_step(policy.chunks, policy.optimizer, policy.scheduler, policy_mbs, policy_step,
                               skip_nonfinite=True)
                guard.record("policy", steps_done["policy"], s)
                first_ratio = s["ratio"] if first_ratio is None else first_ratio
                for k in POLICY_STATS + ("kl_loss_term", "ptx_loss"):
                    if k in s:
                        history[k].append(s[k])
                history["policy_grad_norm"].append(s["grad_norm"])
                history["skipped_steps"].append(s["skipped"])
            if value is None:
                continue
            steps_done["value"] += 1
            s = train_step(value.chunks, value.optimizer, value.scheduler, mbs, value_step, skip_nonfinite=True)
            guard.record("value", steps_done["value"], s)
            history["value_loss"].append(s["value_loss"])
            history["value_clip_fraction"].append(s["value_clip_fraction"])
            history["value_grad_norm"].append(s["grad_norm"])
            history["skipped_steps"].append(s["skipped"])
    stats = {k: sum(v) / len(v) for k, v in history.items() if k != "skipped_steps"}
    stats["skipped_steps"] = sum(history["skipped_steps"])
    if first_ratio is not None:
        stats["ratio_first_minibatch"] = first_ratio
    return stats
