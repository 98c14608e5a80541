"""DPO's end-of-run evaluation: the reference (SFT) and the DPO policy sampled on the same held-out prompts.

After the last step (Stage.finalize), with `dpo.eval_prompts_path` set: the first `dpo.eval_prompts`
prompts, split over data-parallel ranks, are sampled from the reference (the SFT policy) and from the
trained policy with the SAME draws that PPO's evaluation uses (trainer/ppo/eval.py: seed
train.seed + EVAL_SEED_OFFSET, iteration 0), then greedily. Written to <run_dir>/summary.json with the
keys of PPO's summary, `dpo` in place of `ppo`:

    true_reward_sft / true_reward_dpo           mean gold score of the sampled responses (dpo.gold_scorer)
    kl_dpo                                      mean over DPO samples of sum_t (logp - logp_ref)  (k1, nats)
    greedy_true_reward_sft / greedy_true_reward_dpo, response_length_sft / response_length_dpo
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch

from megatron_rlhf.data import dataset as D
from megatron_rlhf.data.tokenizer import stop_ids
from megatron_rlhf.algo import masked
from megatron_rlhf.config.fields import load_gold_scorer
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine
from megatron_rlhf.trainer.ppo.experience import collect_logprobs
from megatron_rlhf.trainer.ppo.eval import EVAL_SEED_OFFSET, generate, gold_scores, uniforms


def _means(values: Dict[str, torch.Tensor], dp_group) -> Dict[str, float]:
    """Per-sequence values [b] of this rank -> means over every data-parallel rank."""
    return {k: float(masked.masked_mean(v.float(), torch.ones_like(v, dtype=torch.float32), dp_group))
            for k, v in values.items()}


@torch.no_grad()
def sample_and_score(policy, reference, prompts: List[List[int]], cfg, tokenizer, dp_rank: int, dp_size: int,
                     gold, greedy: bool, with_kl: bool) -> Dict[str, float]:
    """Responses of `policy` to this rank's share of `prompts`: mean gold score, length, and (with_kl)
    the k1 KL to `reference` per sequence, averaged over all data-parallel ranks."""
    from megatron.core import parallel_state as ps

    d, vocab = cfg.dpo, cfg.model.vocab_size
    n = min(d.eval_prompts, len(prompts)) // dp_size * dp_size
    share = slice(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size)
    draws = None if greedy else uniforms(cfg.train.seed + EVAL_SEED_OFFSET, 0, share, n, d.max_new_tokens)
    engine = MegatronRolloutEngine(policy, eos_id=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id,
                                   vocab_size=vocab)
    exp = generate(engine, prompts[share], tokenizer, SamplingParams(d.max_new_tokens, d.temperature, greedy=greedy),
                   draws)
    mask = exp.response_mask
    values = {"response_length": mask.sum(-1)}
    scores = gold_scores(gold, tokenizer, exp)
    if scores is not None:
        values["true_reward"] = scores
    if with_kl:
        mbs = exp.microbatches(cfg.train.micro_batch_size)
        logp = torch.cat(collect_logprobs(policy, mbs, vocab, d.temperature))
        ref = torch.cat(collect_logprobs(reference, mbs, vocab, d.temperature))
        values["kl"] = ((logp - ref) * mask).sum(-1)
    return _means(values, ps.get_data_parallel_group())


def summary_pass(cfg, chunks, tokenizer, dp_rank: int, dp_size: int, log, *, kept: dict,
                 build_reference: Callable) -> Dict[str, dict]:
    """Stage.finalize of DPO: {"summary": {...}} (-> summary.json and eval/summary_*), or {} when
    `dpo.eval_prompts_path` is not set. `kept`: the dict in which trainer/dpo/fit.py `prepare` keeps the
    reference it built when it stays for the run (`online`); else the reference is loaded again with
    `build_reference(cfg, tokenizer)` (fit.py's, the one `prepare` uses)."""
    d = cfg.dpo
    if d.eval_prompts_path is None:
        return {}
    prompt_cfg = dataclasses.replace(cfg.data, train_path=d.eval_prompts_path, eval_path=None)
    rows, _ = D.load_examples("prompt", prompt_cfg, tokenizer, log=log)
    prompts = list(rows["prompt_ids"])
    reference = kept.get("reference")
    if reference is None:  # with reference_logprobs=precompute it was freed before training: loaded again
        reference = build_reference(cfg, tokenizer)
    gold = load_gold_scorer(d.gold_scorer)
    out: Dict[str, float] = {}
    for greedy in (False, True):
        prefix = "greedy_" if greedy else ""
        for name, model in (("sft", reference), ("dpo", chunks)):
            with_kl = name == "dpo" and not greedy
            got = sample_and_score(model, reference, prompts, cfg, tokenizer, dp_rank, dp_size, gold, greedy, with_kl)
            if "true_reward" in got:
                out[f"{prefix}true_reward_{name}"] = got["true_reward"]
            out[f"{prefix}response_length_{name}"] = got["response_length"]
            if "kl" in got:
                out[f"kl_{name}"] = got["kl"]
    out["eval_prompts"] = min(d.eval_prompts, len(prompts)) // dp_size * dp_size
    if log:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in out.items() if isinstance(v, float))
        log(f"dpo summary on {out['eval_prompts']} held-out prompts: {shown}")
    return {"summary": out}
