"""Reward normalisation statistics: mean and std of RM scores on samples of the SFT policy.

PPO divides RM scores by these (`(score - mean) / std`), so its KL coefficient and clip settings
meet rewards of a known scale (ppo-spec.md, "Normalise RM outputs before RL").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict

import torch

from megatron_rlhf.data import dataset as D
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.data.collate import pad_sequences
from megatron_rlhf.models.heads import last_token_scores
from megatron_rlhf.rollout.megatron_engine import generate_for_prompts
from megatron_rlhf.trainer.step import make_forward_step, reduce_stats, run_schedule


def _score_stats(output, batch):
    scores = last_token_scores(output, batch["lengths"])
    n = torch.tensor(float(scores.numel()))
    zero = torch.zeros(())
    return zero, n, {"score": (scores.sum(), n), "score_sq": ((scores**2).sum(), n),
                     "ended": (batch["ended"].float().sum(), n)}


@torch.no_grad()
def calibrate(cfg, reward_chunks, tokenizer, dp_rank: int, dp_size: int, log=None) -> Dict[str, float]:
    """Sample `calibration.num_prompts` responses from the SFT policy, score them with the RM.

    Returns {"mean", "std", "num_samples", "ended_fraction"}; identical on every rank.
    """
    cal = cfg.calibration
    if cfg.parallel.pp > 1:
        raise ValueError("calibration samples with the megatron sampler, which needs parallel.pp=1: "
                         "set calibration.enabled=false and calibrate in a pp=1 run")
    policy_path = cal.policy_load or cfg.model.load
    if policy_path is None:
        raise ValueError("calibration needs the SFT policy: set calibration.policy_load (or model.load)")
    model_cfg = cfg.model.to_model_config()
    from megatron_rlhf.trainer.run import expected_tokenizer

    policy = ckpt.load_model(policy_path, model_cfg, cfg.parallel, "policy", "lm", fp8=cfg.fp8,
                             key="calibration.policy_load" if cal.policy_load else "model.load",
                             tokenizer=expected_tokenizer(cfg, tokenizer))

    prompt_cfg = dataclasses.replace(cfg.data, train_path=cal.prompts_path or cfg.data.train_path, eval_path=None)
    prompts, _ = D.load_examples("prompt", prompt_cfg, tokenizer, log=log)
    indices = list(range(min(cal.num_prompts, len(prompts))))
    mine = indices[dp_rank::dp_size]
    forward_step = make_forward_step(_score_stats)
    outputs = []
    for start in range(0, len(mine), cal.batch_size):
        rows = [prompts[i] for i in mine[start: start + cal.batch_size]]
        out = generate_for_prompts(policy, rows, tokenizer, vocab_size=model_cfg.vocab_size,
                                   max_new_tokens=cal.max_new_tokens, temperature=cal.temperature,
                                   seed=cfg.train.seed + 7919 * dp_rank + start)
        sequences = []
        for r, p in enumerate(rows):
            n = int(out["lengths"][r])
            sequences.append(list(p["prompt_ids"]) + out["response_ids"][r, :n].tolist())
        ids = pad_sequences(sequences, tokenizer.pad_token_id)
        mbatch = {"input_ids": ids, "lengths": torch.tensor([len(s) for s in sequences]),
                  "ended": out["ended"]}
        outputs += run_schedule(reward_chunks, [mbatch], forward_step, forward_only=True)
    stats = reduce_stats(outputs, names=["ended", "score", "score_sq"])
    mean = stats["score"]
    var = max(stats["score_sq"] - mean**2, 0.0)
    del policy
    return {"mean": mean, "std": math.sqrt(var) if var > 0 else 1.0,
            "num_samples": len(indices), "ended_fraction": stats["ended"]}
