"""The `dpo` config group of `megatron-rlhf dpo` (Direct Preference Optimization, Rafailov et al. 2023).

DPO trains the policy (`model.load`, the SFT checkpoint) on preference pairs (the reward model's data
format: prompt, chosen, rejected) against a frozen reference (the same SFT weights); no reward model,
no sampling during training. `dpo.reference_load` takes the reference from another checkpoint (the SFT
one, when the policy continues from a DPO run). The `train` group sets the optimizer and
`train.global_batch_size` pairs per step; optionally, after the last step, held-out prompts are sampled
from the SFT and the DPO policy with the same draws (`dpo.eval_prompts_path`), as PPO's summary does.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional

from megatron_rlhf.config.fields import help_field as _f
from megatron_rlhf.config.fields import load_gold_scorer, require


@dataclass
class DPOSection:
    """DPO: the policy from model.load, a frozen reference (the same weights unless reference_load), the DPO loss."""

    reference_load: Optional[str] = _f(None, "frozen reference checkpoint; null = model.load. A run that starts "
                                       "its policy from a DPO checkpoint keeps its SFT reference with it")
    beta: float = _f(0.1, "strength of the implicit KL leash: implicit reward = beta * (logp - logp_ref)")
    label_smoothing: float = _f(0.0, "assumed label-flip probability (conservative DPO), in [0, 0.5)")
    reference_logprobs: str = _f(
        "precompute", "precompute: reference logprobs of every pair once up front (the reference is then freed); "
        "online: a reference forward per batch (the reference stays in memory)", choices=("precompute", "online"))
    eval_prompts_path: Optional[str] = _f(
        None, "held-out prompt rows: after the last step, sample them from the SFT and the DPO policy "
        "(same draws) -> summary.json; null = off")
    eval_prompts: int = _f(256, "held-out prompts sampled for summary.json")
    max_new_tokens: int = _f(64, "generation length limit of that evaluation")
    temperature: float = _f(1.0, "sampling temperature of that evaluation")
    gold_scorer: Optional[str] = _f(
        None, "'module:function' (prompts, responses) -> gold scores, e.g. the tiny task's true score")


def validate_dpo(cfg) -> None:
    """Checks of the `dpo` group (one line naming the key and the fix); called by `config.validate`."""
    d = cfg.dpo
    require(cfg.model.load is not None,
            "model.load is not set: DPO starts the policy and the frozen reference from the SFT checkpoint")
    require(d.beta > 0, f"dpo.beta={d.beta} must be > 0 (it scales the implicit reward; 0.1 is common)")
    require(0 <= d.label_smoothing < 0.5,
            f"dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5) (0.5 would make every label a coin flip)")
    require(d.eval_prompts >= 1, f"dpo.eval_prompts={d.eval_prompts} must be >= 1")
    require(d.max_new_tokens >= 1, f"dpo.max_new_tokens={d.max_new_tokens} must be >= 1")
    require(d.temperature > 0, f"dpo.temperature={d.temperature} must be > 0")
    require(d.gold_scorer is None or ":" in d.gold_scorer, f"dpo.gold_scorer={d.gold_scorer!r} must be 'module:function'")
    load_gold_scorer(d.gold_scorer, option="dpo.gold_scorer=")
    if d.eval_prompts_path is None:
        return
    p = d.eval_prompts_path
    require(os.path.exists(p) or bool(glob.glob(p)), f"dpo.eval_prompts_path: '{p}' not found (no file or glob match)")
    check_dpo_layout(cfg)
    prompt_budget = cfg.data.max_prompt_len or cfg.data.max_seq_len
    require(prompt_budget + d.max_new_tokens <= cfg.model.max_position_embeddings,
            f"data.max_prompt_len (or data.max_seq_len) {prompt_budget} + dpo.max_new_tokens {d.max_new_tokens} "
            f"exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}: lower one of them")


def check_dpo_layout(cfg) -> None:
    """What the DPO stage needs of the parallel layout beyond every stage's checks (also the planner's)."""
    require(cfg.dpo.eval_prompts_path is None or (
        cfg.parallel.pp == 1 and cfg.parallel.cp == 1 and not cfg.parallel.sequence_parallel),
        "dpo.eval_prompts_path samples with the Megatron sampler, which needs parallel.pp=1, cp=1 and no "
        "sequence_parallel: set dpo.eval_prompts_path=null for this layout")
