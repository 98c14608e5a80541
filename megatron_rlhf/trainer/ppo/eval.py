"""Held-out evaluation of the PPO policy, the gold scorer, sample panels and the run summary.

Every evaluation uses the same held-out prompts and the same sampling draws, so its numbers are
comparable across iterations and between the SFT policy (iteration 0) and the final policy:

    eval/rm_score, eval/gold_score, eval/kl (per sequence, k1 vs the reference), eval/response_length,
    eval/truncation_rate, and the same for greedy decoding as eval/greedy_*.

The gold scorer (`ppo.gold_scorer: "module:function"`) maps (prompt texts, response texts) to scores
(the tiny task's true score). Response texts keep the EOS token text when the response emitted it,
so a scorer can tell finished from cut-off responses. eval/gold_score beside eval/rm_score is how
reward hacking shows: the RM score rises while the gold score falls.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from megatron_rlhf.algo import masked
from megatron_rlhf.config.fields import ConfigError, GoldScorer
from megatron_rlhf.parallel.report import first_problem
from megatron_rlhf.trainer.ppo.batch import Experience, build_experience
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.trainer.ppo.experience import Frozen, score_and_recompute

EVAL_SEED_OFFSET = 7_777_777  # eval draws never coincide with a training iteration's


def texts(tokenizer, exp: Experience) -> tuple[List[str], List[str]]:
    """(prompt texts without special tokens, response texts with the EOS token when emitted)."""
    prompts, responses = [], []
    for i in range(exp.size):
        prompt = exp.input_ids[i, : int(exp.prompt_lengths[i])].tolist()
        response = exp.response_ids[i, : int(exp.response_mask[i].sum())].tolist()
        prompts.append(tokenizer.decode(prompt, skip_special_tokens=True))
        responses.append(tokenizer.decode(response, skip_special_tokens=False))
    return prompts, responses


def gold_scores(gold: Optional[GoldScorer], tokenizer, exp: Experience) -> Optional[torch.Tensor]:
    if gold is None:
        return None
    return score_texts(gold, *texts(tokenizer, exp))


def score_texts(gold: GoldScorer, prompts: List[str], responses: List[str]) -> torch.Tensor:
    """The scorer's scores of these pairs, checked on every rank together (collective): whatever it does wrong
    on any rank (raises, returns too many, too few, None, strings, NaN) is one ConfigError on every rank."""
    scores, problem = None, None
    try:
        raw = gold(prompts, responses)
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, with the prompt it failed on
        problem = f"raised {type(e).__name__}: {e}{_failing_prompt(gold, prompts, responses)}"
    else:
        scores, problem = _as_scores(raw, prompts)
    first = first_problem(problem)
    if first is not None:
        name = f"{getattr(gold, '__module__', '?')}:{getattr(gold, '__qualname__', gold)}"
        raise ConfigError(f"ppo.gold_scorer ({name}) {first}: it must return one finite number per "
                          "(prompt, response) pair, in order")
    return scores


def _failing_prompt(gold: GoldScorer, prompts: List[str], responses: List[str]) -> str:
    """`on prompt '...'`: the first pair the scorer fails on alone (empty if it fails on none alone)."""
    for p, r in zip(prompts, responses):
        try:
            gold([p], [r])
        except Exception:  # noqa: BLE001
            return f" on prompt {p!r} (response {r!r})"
    return ""


def _as_scores(raw, prompts: List[str]) -> tuple[Optional[torch.Tensor], Optional[str]]:
    if raw is None or isinstance(raw, (str, bytes)) or not hasattr(raw, "__len__"):
        return None, f"returned {_shown(raw)} for {len(prompts)} pairs"
    values = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    if len(values) != len(prompts):
        return None, f"returned {len(values)} scores for {len(prompts)} pairs"
    out = []
    for prompt, v in zip(prompts, values):
        try:
            if v is None or isinstance(v, (str, bytes, bool)):
                raise TypeError
            out.append(float(v))
        except (TypeError, ValueError):
            return None, f"returned {_shown(v)} for prompt {prompt!r}"
        if not math.isfinite(out[-1]):
            return None, f"returned {out[-1]} for prompt {prompt!r}"
    return torch.tensor(out, dtype=torch.float32), None


def _shown(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:40] + '...'}"


def uniforms(seed: int, iteration: int, rows: slice, total: int, max_new_tokens: int) -> torch.Tensor:
    """[rows, T] sampling draws of global rows `rows` out of `total`, a function of (seed, iteration) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration + 1)
    return torch.rand(total, max_new_tokens, generator=g)[rows]


def ppo_sampling(p, greedy: bool = False) -> SamplingParams:
    """How the `ppo` config group samples: temperature, top-k / top-p, max new tokens."""
    return SamplingParams(p.max_new_tokens, p.temperature, greedy=greedy, top_k=p.top_k, top_p=p.top_p)


def generate(engine, prompt_rows: List[List[int]], tokenizer, sampling: SamplingParams,
             draws: Optional[torch.Tensor]) -> Experience:
    """Left-pad the prompts, generate, and assemble the rollout part of an Experience."""
    from megatron_rlhf.data.collate import collate_prompts

    batch = collate_prompts([{"prompt_ids": p} for p in prompt_rows], pad_id=tokenizer.pad_token_id)
    out = engine.generate(batch["input_ids"], batch["attention_mask"], sampling, uniforms=draws)
    return build_experience(prompt_rows, out, tokenizer.pad_token_id)


@torch.no_grad()
def evaluate(engine, models: Dict[str, list], frozen: Frozen, prompts: List[List[int]], cfg, dp_rank: int,
             dp_size: int, tokenizer, gold: Optional[GoldScorer], dp_group=None,
             samples: Optional[List[dict]] = None) -> Dict[str, float]:
    """Sampled and greedy responses to the first `ppo.eval_prompts` held-out prompts (split over DP ranks).

    `samples` (a list, given on rank 0): receives this rank's first `SAMPLE_ROWS` sampled responses as
    {"prompt", "response", "rm_score", "gold_score" (None without a gold scorer)}."""
    p = cfg.ppo
    n = min(p.eval_prompts, len(prompts)) // dp_size * dp_size
    share = slice(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size)
    mine = prompts[share]
    forward = {k: v for k, v in models.items() if k != "value"}
    result: Dict[str, float] = {}
    with engine.same_weights():  # one weight copy for both passes
        for mode in ("sample", "greedy"):
            greedy = mode == "greedy"
            draws = None if greedy else uniforms(cfg.train.seed + EVAL_SEED_OFFSET, 0, share, n, p.max_new_tokens)
            exp = score_and_recompute(generate(engine, mine, tokenizer, ppo_sampling(p, greedy), draws), forward, frozen,
                                      cfg.train.micro_batch_size, with_values=False)
            prefix = "eval/greedy_" if greedy else "eval/"
            golds = gold_scores(gold, tokenizer, exp)
            for k, v in sequence_means(exp, golds, dp_group).items():
                result[prefix + k] = v
            if samples is not None and not greedy:
                samples.extend(sample_rows(exp, tokenizer, golds))
    return result


SAMPLE_ROWS = 8  # held-out samples per evaluation in samples.jsonl (the run report's table)


def sample_rows(exp: Experience, tokenizer, golds: Optional[torch.Tensor], rows: int = SAMPLE_ROWS) -> List[dict]:
    """The first `rows` rollouts as {"prompt", "response", "rm_score", "gold_score"} (texts as `texts`)."""
    part = exp.rows(range(min(rows, exp.size)))
    prompts, responses = texts(tokenizer, part)
    return [{"prompt": prompts[i], "response": responses[i], "rm_score": float(part.rm_scores[i]),
             "gold_score": float(golds[i]) if golds is not None else None} for i in range(part.size)]


def sequence_means(exp: Experience, gold: Optional[torch.Tensor], dp_group=None) -> Dict[str, float]:
    """Per-sequence means over all DP ranks: rm_score, kl, response_length, truncation_rate, gold_score."""
    ones = torch.ones(exp.size)
    kl = ((exp.logprobs - exp.ref_logprobs) * exp.response_mask).sum(-1)
    values = {"rm_score": exp.rm_scores, "kl": kl, "response_length": exp.response_mask.sum(-1),
              "truncation_rate": (~exp.ended).float()}
    if gold is not None:
        values["gold_score"] = gold
    return {k: float(masked.masked_mean(v.float(), ones, dp_group)) for k, v in values.items()}


def sample_panel(exp: Experience, tokenizer, gold: Optional[GoldScorer], rows: int = 8) -> str:
    """A text table of the first `rows` rollouts: prompt | response | RM score | gold score."""
    part = exp.rows(range(min(rows, exp.size)))
    prompts, responses = texts(tokenizer, part)
    golds = score_texts(gold, prompts, responses).tolist() if gold is not None else [float("nan")] * part.size
    lines = ["prompt | response | rm_score | gold_score"]
    for i in range(part.size):
        lines.append(f"{prompts[i]} | {responses[i]} | {float(part.rm_scores[i]):.3f} | {float(golds[i]):.3f}")
    return "\n".join(lines)


def summary(baseline: Dict[str, float], final: Dict[str, float], extra: Dict[str, float]) -> Dict[str, float]:
    """summary.json: the SFT policy (iteration-0 eval) against the final policy on the same prompts."""
    out = {
        "true_reward_sft": baseline.get("eval/gold_score"), "true_reward_ppo": final.get("eval/gold_score"),
        "rm_reward_sft": baseline.get("eval/rm_score"), "rm_reward_ppo": final.get("eval/rm_score"),
        "kl_ppo": final.get("eval/kl"),
        "greedy_true_reward_sft": baseline.get("eval/greedy_gold_score"),
        "greedy_true_reward_ppo": final.get("eval/greedy_gold_score"),
        "response_length_sft": baseline.get("eval/response_length"),
        "response_length_ppo": final.get("eval/response_length"),
    }
    out.update(extra)
    return out
