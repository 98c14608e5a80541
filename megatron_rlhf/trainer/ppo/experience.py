"""Phases 2-4 of a PPO iteration, on this data-parallel rank's rollouts:

    2. score:       reward model at the last real token; no EOS -> -missing_eos_penalty; normalised
    3. recompute:   policy logprobs (PPO's old logprobs; or the sampler's, ppo.old_logprobs), reference
                    logprobs, values
    4. advantages:  shaped rewards -> GAE -> whitening over all data-parallel ranks (the critic-free
                    estimators: trainer/ppo/critic_free.py)

Every forward goes through Megatron's schedule (`run_schedule`, forward only), so pipelined layouts
work the same way; per-token outputs are read at the response positions of `Experience.response_index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_rlhf.algo import advantages as adv
from megatron_rlhf.algo import masked
from megatron_rlhf.algo.correction import correction_weights
from megatron_rlhf.algo.rewards import penalize_missing_eos, shaped_rewards
from megatron_rlhf.trainer.ppo.batch import Experience
from megatron_rlhf.models import heads, packing
from megatron_rlhf.models.logit_rows import pick_rows
from megatron_rlhf.models.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from megatron_rlhf.parallel.device import on_device_of
from megatron_rlhf.trainer.step import model_forward, pipeline_stages, run_schedule, scatter_rows

Batch = Dict[str, torch.Tensor]


@dataclass
class Frozen:
    """What scoring needs besides the models: vocabulary, temperature and reward normalisation.

    `reward_rows` (ppo.reward_tokenizer): a policy micro-batch -> the reward model's own rows of it
    (trainer/ppo/reward_tokens.py); None: the reward model reads the policy's tokens."""

    vocab_size: int
    temperature: float
    reward_mean: float = 0.0
    reward_std: float = 1.0
    missing_eos_penalty: float = 1.0
    reward_rows: Optional[Callable[[Batch], Batch]] = None


def tp_group():
    """The tensor-parallel group the vocabulary is split over, or None without TP."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def response_rows(mb: Batch) -> torch.Tensor:
    """[b, T]: the positions whose logits predict the response tokens, -1 after each response (no one reads
    them); with `logits_at`, the forward projects only these (models/logit_rows.py), packed only the real ones
    (step.model_forward). PPO-ptx micro-batches (no response) get None: every position."""
    index = mb.get("response_index")
    if index is None or not packing.enabled():
        return index
    return index.masked_fill(mb["response_mask"] == 0, -1)


def _response_logits(logits: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Logits over every position [b, S, V/tp], or already at the response rows [b, T, V/tp] (a forward with
    `rows=response_rows`) -> [b, T, V/tp]. The two cannot be confused: S > T, as every prompt has a token."""
    index = mb["response_index"]
    return logits if logits.shape[1] == index.shape[1] else pick_rows(logits, index)


def per_response_token(fn: Callable, logits: torch.Tensor, mb: Batch):
    """`fn(logits [n, t, V/tp], response ids [n, t])` -> one or a tuple of [n, t] tensors, as [b, T] each: from
    logits [b, S or T, V/tp], or a packed forward's [1, N, V/tp] at the real response rows alone (mb["rows_kept"],
    step.model_forward), whose results are laid back out with 0 after each response."""
    kept = mb.get("rows_kept")
    if kept is None:
        return fn(_response_logits(logits, mb), mb["response_ids"])
    out = fn(logits, mb["response_ids"][kept].unsqueeze(0))
    return tuple(scatter_rows(o, kept) for o in out) if isinstance(out, tuple) else scatter_rows(out, kept)


def response_logprobs(logits: torch.Tensor, mb: Batch, vocab_size: int, temperature: float) -> torch.Tensor:
    """Vocab-parallel logits (`per_response_token`) -> log-probs [b, T] of the response tokens (padded ids excluded)."""
    return per_response_token(lambda z, y: token_logprobs(z, y, tp_group(), vocab_size, temperature), logits, mb)


def response_logprobs_and_entropy(logits: torch.Tensor, mb: Batch, vocab_size: int, temperature: float):
    """Vocab-parallel logits (`per_response_token`) -> (log-probs [b, T], entropy [b, T], not differentiable) of
    the response tokens, from one softmax."""
    return per_response_token(lambda z, y: token_logprobs_and_entropy(z, y, tp_group(), vocab_size, temperature),
                              logits, mb)


def response_entropy(logits: torch.Tensor, mb: Batch, vocab_size: int, temperature: float) -> torch.Tensor:
    """Vocab-parallel logits (`per_response_token`) -> entropy [b, T] of the policy at each response position."""
    return per_response_token(lambda z, y: token_entropy(z, tp_group(), vocab_size, temperature), logits, mb)


def collect_logprobs(chunks, microbatches: List[Batch], vocab_size: int, temperature: float) -> List[torch.Tensor]:
    """Forward-only log-probs [b, T] of the response tokens per micro-batch, the output layer run at the
    response positions only."""
    return forward_collect(chunks, microbatches, lambda o, mb: response_logprobs(o, mb, vocab_size, temperature),
                           rows=response_rows)


def response_values(output: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Scalar-head output [b, S, 1] -> V(s_t) [b, T] (fp32): the outputs at each response token's predicting
    position."""
    return pick_rows(output, mb["response_index"]).squeeze(-1).float()


def scoring_rows(mb: Batch) -> Batch:
    """A policy micro-batch as the reward model reads it with the policy's tokens: {input_ids [b, S], lengths [b]
    (prompt + response tokens, the score is read at lengths - 1)}. With ppo.reward_tokenizer the reward model
    gets rows of the same form in its own tokens (Frozen.reward_rows)."""
    return {"input_ids": mb["input_ids"], "lengths": mb["prompt_lengths"] + mb["response_mask"].sum(-1).long()}


def last_token_scores(output: torch.Tensor, rows: Batch) -> torch.Tensor:
    """Scalar-head output [b, S, 1] -> [b] at each row's last real token (`rows` from `scoring_rows`)."""
    return heads.last_token_scores(output, rows["lengths"])


def forward_collect(chunks, microbatches: List[Batch], extract: Callable[[torch.Tensor, Batch], torch.Tensor],
                    rows: Optional[Callable[[Batch], torch.Tensor]] = None) -> List[torch.Tensor]:
    """Forward-only pass; `extract(output, mb)` per micro-batch, returned on every pipeline rank.

    `rows(mb)` ([b, T] positions, e.g. `response_rows`): an LM's logits come only at those rows, [b, T, V/tp].

    `chunks` may be a frozen model in its own layout (trainer/ppo/inference_layout.py): it computes the
    same quantity for the rows of all micro-batches at once, or a reference kept in host memory
    (trainer/ppo/reference_swap.py): the policy's chunks run with the reference weights swapped in."""
    from megatron.core import parallel_state as ps

    if hasattr(chunks, "collect_rows"):
        return [chunks.collect_rows(microbatches)]
    if hasattr(chunks, "swaps_into"):
        with chunks.swapped() as policy:
            return forward_collect(policy, microbatches, extract, rows)

    def forward_step(data_iterator, model):
        mb = on_device_of(model, next(data_iterator))
        output = model_forward(model, mb, rows(mb) if rows else None)

        def loss_func(out):  # the results join the Experience, which lives on the host
            return torch.zeros(()), torch.tensor(1, dtype=torch.int), {"out": extract(out, mb).detach().cpu()}

        return output, loss_func

    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    with torch.no_grad():
        outputs = run_schedule(chunks, microbatches, forward_step, forward_only=True)
    for c, mode in zip(chunks, modes):
        c.train(mode)
    results = [o["out"] for o in outputs]
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage computed them
        box = [results]
        torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                                group=ps.get_pipeline_model_parallel_group())
        results = box[0]
    return results


def score_and_recompute(exp: Experience, models: Dict[str, list], frozen: Frozen, micro_batch_size: int,
                        with_values: bool = True, old_logprobs: str = "recompute",
                        max_tokens: Optional[int] = None) -> Experience:
    """Phases 2-3: fills logprobs, ref_logprobs, values, rm_scores and scores of `exp` (in place; returned).

    `models`: chunks by name ("policy", "reference", "reward" and, with `with_values`, "value"; without a
    "value" model, the critic-free estimators, exp.values stays None). `old_logprobs` (ppo.old_logprobs):
    "sampler" takes exp.logprobs from exp.sampler_logprobs instead of a policy forward."""
    mbs = exp.microbatches(micro_batch_size, max_tokens=max_tokens)
    v, t = frozen.vocab_size, frozen.temperature
    cat = lambda parts: torch.cat(parts)  # noqa: E731
    exp.rm_scores, exp.scores = score_responses(models["reward"], mbs, frozen)
    if old_logprobs == "sampler":
        exp.logprobs = exp.sampler_logprobs  # the mask product below makes it a tensor of its own
    else:
        exp.logprobs = cat(collect_logprobs(models["policy"], mbs, v, t))
    exp.ref_logprobs = cat(collect_logprobs(models["reference"], mbs, v, t))
    mask = exp.response_mask
    if with_values and "value" in models:
        exp.values = cat(forward_collect(models["value"], mbs, response_values)) * mask
    exp.logprobs, exp.ref_logprobs = exp.logprobs * mask, exp.ref_logprobs * mask
    return exp


def score_responses(reward_chunks, microbatches: List[Batch], frozen: Frozen) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2 alone: (normalised RM scores [B], scores [B] with -missing_eos_penalty where no EOS: the policy's
    own stop set, read from the policy micro-batches)."""
    rows = [(frozen.reward_rows or scoring_rows)(mb) for mb in microbatches]
    if frozen.reward_rows is not None:  # rows of their own widths: one through a pipeline, multiples of TP under SP
        rows = packing.pad_widths(rows, pipeline_stages() > 1)
    raw = torch.cat(forward_collect(reward_chunks, rows, last_token_scores))
    rm_scores = (raw - frozen.reward_mean) / frozen.reward_std
    return rm_scores, penalize_missing_eos(rm_scores, _ended(microbatches), -frozen.missing_eos_penalty)


def _ended(microbatches: List[Batch]) -> torch.Tensor:
    """[B] bool: which responses emitted EOS, concatenated over the micro-batches."""
    return torch.cat([mb["ended"] for mb in microbatches])


def estimate_advantages(exp: Experience, beta: float, kl_estimator: str, gamma: float, lam: float,
                        whiten: bool, dp_group=None) -> Experience:
    """Phase 4: shaped rewards, GAE (advantages, returns), advantages whitened over `dp_group`."""
    mask = exp.response_mask
    exp.rewards = shaped_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, beta, kl_estimator)
    advantages, exp.returns = adv.gae(exp.rewards, exp.values, mask, gamma=gamma, lam=lam)
    exp.advantages = masked.whiten(advantages, mask, group=dp_group) if whiten else advantages
    return exp


def rollout_stats(exp: Experience, dp_group=None, correction: Tuple[str, float] = ("none", 2.0)) -> Dict[str, torch.Tensor]:
    """Rollout diagnostics as global means over `dp_group` (0-dim tensors; the trainer logs them).

    kl_per_seq: sum over tokens of the k1 estimate (logp - logp_ref), mean over sequences;
    rho = exp(trainer logp - sampler logp) per token: mean, mean |rho - 1|, max. With a rollout
    correction (ppo.rollout_correction, cap): correction_weight (mean token weight), and the fraction of
    tokens truncated (tis) or masked (mis).
    """
    mask = exp.response_mask
    seq = torch.ones_like(exp.scores)
    log_ratio = (exp.logprobs - exp.ref_logprobs) * mask
    rho = torch.exp((exp.logprobs - exp.sampler_logprobs) * mask)
    rho_max = (rho * mask).max() if mask.sum() > 0 else torch.ones(())
    if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(rho_max, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    stats = {} if exp.values is None else {  # the critic-free estimators have no value model
        "value_explained_variance": explained_variance(exp.values, exp.returns, mask, dp_group),
        "return_mean": masked.masked_mean(exp.returns, mask, dp_group),
    }
    if correction[0] != "none":
        weights, capped = correction_weights(exp.logprobs, exp.sampler_logprobs, mask, *correction)
        stats["correction_weight"] = masked.masked_mean(weights, mask, dp_group)
        name = "truncated" if correction[0] == "tis" else "masked"
        stats[f"correction_{name}_fraction"] = masked.masked_mean(capped, mask, dp_group)
    return {
        **stats,
        "rm_score": masked.masked_mean(exp.rm_scores, seq, dp_group),
        "score": masked.masked_mean(exp.scores, seq, dp_group),
        "kl_per_seq": masked.masked_mean(log_ratio.sum(-1), seq, dp_group),
        "kl_per_token": masked.masked_mean(log_ratio, mask, dp_group),
        "response_length": masked.masked_mean(mask.sum(-1), seq, dp_group),
        "truncation_rate": masked.masked_mean((~exp.ended).float(), seq, dp_group),
        "rho_mean": masked.masked_mean(rho, mask, dp_group),
        "rho_abs_dev": masked.masked_mean((rho - 1).abs(), mask, dp_group),
        "rho_max": rho_max,
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over real tokens (global over `group`)."""
    var_returns = masked.masked_var(returns, mask, group)
    var_error = masked.masked_var(returns - values, mask, group)
    return 1.0 - var_error / var_returns.clamp(min=1e-8)
