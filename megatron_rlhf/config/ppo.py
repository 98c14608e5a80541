"""The `ppo` config group of `megatron-rlhf ppo` (defaults follow ppo-spec.md and tiny-task.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from megatron_rlhf.config.fields import ConfigError, paths_exist, require
from megatron_rlhf.config.fields import help_field as _f


@dataclass
class DoctorConfig:
    """Thresholds of the live warnings (trainer/ppo/doctor.py); the defaults are conservative enough for a healthy run to stay silent."""

    early: int = 5  # first observations averaged into a metric's "initial level" (KL, entropy, truncation)
    repeat_every: int = 10  # emit a warning at most once per this many iterations (per name)
    kl_window: int = 5  # kl_blowup: KL rose by more than kl_jump nats over this many iterations...
    kl_jump: float = 2.0
    kl_multiple: float = 10.0  # ...or exceeds kl_multiple * max(initial KL, kl_floor)
    kl_floor: float = 1.0  # the initial KL is ~0 (policy == reference), so floor it: default limit 10 nats
    clip_fraction_max: float = 0.3  # clip_fraction: fraction of clipped ratios above this
    approx_kl_max: float = 0.05  # approx_kl: 0.5*mean((logp_new-logp_old)^2) above this
    negative_kl_window: int = 3  # negative_kl: mean KL per sequence over this window below -negative_kl_tol
    negative_kl_tol: float = 0.05  # nats per sequence; k1 is unbiased, so only noise makes it dip below 0
    ev_warmup: int = 20  # value_lag: only after this many observations (the value model starts cold)
    ev_window: int = 5
    ev_min: float = 0.0  # value_lag: windowed mean explained variance <= this
    entropy_fraction: float = 0.5  # entropy_collapse: below this fraction of its initial level...
    entropy_window: int = 5  # ...for this many observations in a row (steadily, not a dip)
    truncation_margin: float = 0.1  # truncation_rising: windowed mean above initial + margin...
    truncation_window: int = 5  # ...and above the mean of the window before it (still rising)
    rho_tol: float = 0.05  # rho_off: |mean sampler/trainer ratio - 1| above this
    eval_window: int = 3  # reward_hacking: over the last this many evals, gold fell and RM rose...
    eval_tol: float = 0.01  # ...each by more than this (score units)
    no_signal_fraction: float = 0.5  # no_signal: mean fraction of all-equal groups above this...
    no_signal_window: int = 3  # ...over this many observations

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(f.default, int) and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ppo.doctor.{f.name}={v!r} must be an integer >= 1")
            if not isinstance(v, (int, float)) or not math.isfinite(v) or (v < 0 and f.name != "ev_min"):
                raise ValueError(f"ppo.doctor.{f.name}={v!r} must be a finite number >= 0")


@dataclass
class PPOSection:
    """PPO: four models (policy, value, frozen reference, frozen reward), rollout -> score -> learn."""

    reward_load: Optional[str] = _f(None, "reward model checkpoint (stage 2 output; its reward_calibration is used)")
    value_load: Optional[str] = _f(None, "value model init checkpoint: a reward model, or a PPO checkpoint "
                                   "(its value model); null = reward_load")
    reward_tokenizer: Optional[str] = _f(None, "the reward model's own tokenizer (an HF tokenizer directory), when "
                                         "it is not the policy's: responses are decoded and rendered for it (its "
                                         "chat template for message prompts); null = tokenizer.path")
    reward_hf_config: Optional[str] = _f(None, "HF config.json (or its directory) of the reward model: its "
                                         "architecture where ppo.reward_load is not readable here (planning a recipe "
                                         "away from its cluster); checked against the checkpoint's when both are")
    reference_load: Optional[str] = _f(None, "frozen reference (the KL anchor) checkpoint; null = model.load. A run "
                                       "that starts its policy from a PPO checkpoint keeps its SFT reference with it")
    value_head: str = _f("rm", "value head: the RM's scalar head, or a fresh zero head", choices=("rm", "fresh"))
    value_lr: Optional[float] = _f(None, "value model lr; null = train.lr")
    value_warmup_iterations: int = _f(0, "first N iterations train only the value model")
    iterations: int = _f(100, "PPO iterations (rollout + learn)")
    rollout_batch_size: int = _f(128, "prompts per iteration, over all data-parallel ranks")
    minibatch_size: int = _f(64, "rollouts per optimizer step, over all data-parallel ranks")
    epochs: int = _f(2, "passes over each rollout batch")
    max_new_tokens: int = _f(64, "generation length limit")
    temperature: float = _f(1.0, "sampling temperature (logprobs are taken at the same temperature)")
    top_k: int = _f(0, "sample among the k most likely tokens only; 0 = off. The trainer's log-probs stay over the "
                    "whole vocabulary, so PPO's ratio then also corrects for the truncation (ppo/rho_* show it)")
    top_p: float = _f(1.0, "nucleus sampling: the smallest set of most likely tokens with this mass; 1 = off (see top_k)")
    old_logprobs: str = _f("recompute", "PPO's pi_old: recompute = a policy forward over the rollouts in the trainer's "
                           "numerics (the first minibatch's ratio is exactly 1); sampler = the log-probs the generation "
                           "engine reported, one policy forward fewer per iteration (as TRL's PPOTrainer takes them), "
                           "their numerical gap to the trainer then entering the ratio and the KL reward",
                           choices=("recompute", "sampler"))
    rollout_correction: str = _f("none", "weights on the policy loss for the sampler/trainer gap w = pi_old / "
                                 "sampler per token (algo/correction.py): tis = min(w, cap), mis = w inside "
                                 "[1/cap, cap] and 0 outside", choices=("none", "tis", "mis"))
    rollout_correction_cap: float = _f(2.0, "the cap C of ppo.rollout_correction (> 1)")
    beta: float = _f(0.05, "KL penalty coefficient (initial value when adaptive)")
    kl_estimator: str = _f("k1", "per-token KL estimator (k3 with kl_in=loss, as GRPO)", choices=("k1", "k2", "k3"))
    kl_in: str = _f("reward", "where the KL to the reference goes: shaped into the reward (PPO) or a "
                    "beta x KL term in the policy loss (GRPO)", choices=("reward", "loss"))
    advantage_estimator: str = _f("gae", "gae (value model) or a critic-free baseline: grpo/rloo (group of "
                                  "ppo.samples_per_prompt), remax (greedy response); docs/methods.md",
                                  choices=("gae", "grpo", "rloo", "remax"))
    samples_per_prompt: int = _f(1, "responses sampled per prompt (grpo/rloo: the group size, >= 2)")
    ptx_coef: float = _f(0.0, "PPO-ptx: each policy update adds ptx_coef x the LM loss on a batch of ppo.ptx_data")
    ptx_data: Optional[str] = _f(None, "PPO-ptx text: SFT-format rows (prompt, response); ppo.minibatch_size per update")
    adaptive_kl_target: Optional[float] = _f(None, "target KL per sequence (nats); null = fixed beta")
    adaptive_kl_gain: float = _f(0.1, "adaptive KL proportional gain")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    clip_eps: float = _f(0.2, "policy ratio clip")
    value_clip_eps: float = _f(0.2, "value clip")
    vf_coef: float = _f(0.1, "value-loss coefficient")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    whiten_advantages: bool = _f(True, "whiten advantages over the whole rollout batch (all DP ranks)")
    normalize_reward: bool = _f(True, "normalise RM scores with the RM checkpoint's reward_calibration")
    missing_eos_penalty: float = _f(1.0, "a response without EOS scores -this (instead of the RM score)")
    eval_interval: int = _f(10, "evaluate on held-out prompts every N iterations (and at 0 and the end); 0 = ends only")
    eval_prompts: int = _f(256, "held-out prompts per evaluation (data.eval_path)")
    sample_interval: int = _f(10, "write a text panel of sample responses every N iterations; 0 = off")
    gold_scorer: Optional[str] = _f(None, "'module:function' (prompts, responses) -> gold scores, e.g. the tiny task's true score")
    doctor: DoctorConfig = _f(help="thresholds of the live warnings (trainer/ppo/doctor.py), e.g. ppo.doctor.entropy_fraction=0.1",
                              factory=DoctorConfig)
    max_consecutive_skips: int = _f(3, "stop after this many optimizer steps in a row skipped for NaN/Inf")
    inference_tp: Optional[int] = _f(None, "reference and reward models in their own layout: TP=this, PP=1, "
                                     "DP=world/this (loaded resharded); null = the training layout")
    reward_inference_tp: Optional[int] = _f(None, "the reward model's own inference TP (PP=1) where it differs from "
                                            "the reference's, e.g. an 8B reward model at TP=2 beside a 70B reference "
                                            "at ppo.inference_tp=8; null = ppo.inference_tp")
    reference_mode: str = _f("separate", "separate: the reference is a second model; swap: its weights stay in host "
                             "memory and are swapped into the policy for the reference forward",
                             choices=("separate", "swap"))
    offload_frozen: bool = _f(False, "GPU: keep reference and reward weights on the CPU between uses")
    export_hf: bool = _f(True, "export the final policy to <run_dir>/hf_policy (transformers format)")


def validate_ppo(cfg) -> None:
    """Checks of the `ppo` group that need no world size (the data-parallel split is checked at start)."""
    p = cfg.ppo
    require(p.reward_load is not None, "ppo.reward_load is not set: give the reward model checkpoint (stage 2 output)")
    require(cfg.model.load is not None, "model.load is not set: PPO starts the policy and the reference from the SFT checkpoint")
    require(p.reward_tokenizer is None or paths_exist(p.reward_tokenizer),
            f"ppo.reward_tokenizer: '{p.reward_tokenizer}' not found: give the reward model's HF tokenizer directory")
    require(p.reward_hf_config is None or paths_exist(p.reward_hf_config),
            f"ppo.reward_hf_config: '{p.reward_hf_config}' not found")
    for name in ("iterations", "rollout_batch_size", "minibatch_size", "epochs", "max_new_tokens", "eval_prompts",
                 "max_consecutive_skips"):
        v = getattr(p, name)
        require(v >= 1, f"ppo.{name}={v} must be >= 1")
    validate_siblings(cfg)
    require(p.reference_load is None or p.reference_mode == "separate",
            f"ppo.reference_load with ppo.reference_mode={p.reference_mode}: the swapped reference is the policy's "
            "initial weights (model.load); set ppo.reference_mode=separate or remove ppo.reference_load")
    require(p.temperature > 0, f"ppo.temperature={p.temperature} must be > 0")
    require(p.top_k >= 0, f"ppo.top_k={p.top_k} must be >= 0 (0: off)")
    require(0 < p.top_p <= 1, f"ppo.top_p={p.top_p} must be in (0, 1] (1: off)")
    if p.old_logprobs == "sampler":
        require(p.top_k == 0 and p.top_p == 1, f"ppo.old_logprobs=sampler with ppo.top_k={p.top_k}, ppo.top_p={p.top_p}: "
                "the sampler's log-probs are under the truncated distribution, not the policy's; use "
                "ppo.old_logprobs=recompute or turn the truncation off (top_k=0, top_p=1)")
        require(p.rollout_correction == "none", f"ppo.old_logprobs=sampler with ppo.rollout_correction="
                f"{p.rollout_correction}: the correction weighs pi_old against the sampler, which are then the same; "
                "use ppo.old_logprobs=recompute or ppo.rollout_correction=none")
    require(math.isfinite(p.rollout_correction_cap) and p.rollout_correction_cap > 1,
            f"ppo.rollout_correction_cap={p.rollout_correction_cap} must be a finite number > 1")
    require(math.isfinite(p.beta) and p.beta >= 0, f"ppo.beta={p.beta} must be a finite number >= 0")
    require(p.adaptive_kl_target is None or p.adaptive_kl_target > 0,
            f"ppo.adaptive_kl_target={p.adaptive_kl_target} must be > 0 or null")
    require(p.adaptive_kl_target is None or p.beta > 0, "ppo.adaptive_kl_target needs ppo.beta > 0 to scale from")
    require(0 < p.lam <= 1 and 0 < p.gamma <= 1, f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must be in (0, 1]")
    require(p.clip_eps > 0 and p.value_clip_eps > 0, "ppo.clip_eps and ppo.value_clip_eps must be > 0")
    require(p.vf_coef > 0, f"ppo.vf_coef={p.vf_coef} must be > 0")
    require(p.entropy_coef >= 0, f"ppo.entropy_coef={p.entropy_coef} must be >= 0")
    require(p.value_lr is None or p.value_lr > 0, f"ppo.value_lr={p.value_lr} must be > 0 or null")
    require(0 <= p.value_warmup_iterations < p.iterations,
            f"ppo.value_warmup_iterations={p.value_warmup_iterations} must be in [0, ppo.iterations={p.iterations})")
    require(p.eval_interval >= 0 and p.sample_interval >= 0, "ppo.eval_interval and ppo.sample_interval must be >= 0")
    prompt_budget = cfg.data.max_prompt_len or cfg.data.max_seq_len
    require(prompt_budget + p.max_new_tokens <= cfg.model.max_position_embeddings,
            f"data.max_prompt_len (or data.max_seq_len) {prompt_budget} + ppo.max_new_tokens {p.max_new_tokens} exceeds "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}: lower one of them")
    require(p.gold_scorer is None or ":" in p.gold_scorer,
            f"ppo.gold_scorer={p.gold_scorer!r} must be 'module:function'")


def critic_free(p) -> bool:
    """True for the estimators without a value model (grpo, rloo, remax)."""
    return p.advantage_estimator != "gae"


def _group(cfg) -> str:
    """The config group of the stage with a frozen reference: "ppo" or "dpo"."""
    return "ppo" if hasattr(cfg, "ppo") else "dpo"


def reference_source(cfg) -> tuple:
    """(checkpoint, setting) the frozen reference of PPO or DPO comes from: <group>.reference_load, else the
    policy's model.load."""
    group = _group(cfg)
    load = getattr(cfg, group).reference_load
    return (load, f"{group}.reference_load") if load else (cfg.model.load, "model.load")


def rollouts_per_iteration(p) -> int:
    """Responses trained on per iteration: rollout_batch_size prompts x samples_per_prompt."""
    return p.rollout_batch_size * p.samples_per_prompt


def validate_siblings(cfg) -> None:
    """The critic-free estimators, where the KL goes, PPO-ptx, and the batch they imply."""
    p, k = cfg.ppo, cfg.ppo.samples_per_prompt
    require(k >= 1, f"ppo.samples_per_prompt={k} must be >= 1")
    if p.advantage_estimator in ("grpo", "rloo"):
        require(k >= 2, f"ppo.advantage_estimator={p.advantage_estimator} needs ppo.samples_per_prompt >= 2 "
                f"(got {k}): a group baseline needs at least two responses per prompt")
    elif k != 1:
        raise ConfigError(f"ppo.samples_per_prompt={k} is only for grpo/rloo (ppo.advantage_estimator="
                          f"{p.advantage_estimator}): set it to 1")
    if critic_free(p):
        require(p.value_warmup_iterations == 0, f"ppo.value_warmup_iterations={p.value_warmup_iterations} needs a value "
                f"model, which ppo.advantage_estimator={p.advantage_estimator} does not build: set it to 0")
    require(rollouts_per_iteration(p) % p.minibatch_size == 0,
            f"ppo.rollout_batch_size x ppo.samples_per_prompt = {p.rollout_batch_size}x{k} rollouts must be a multiple "
            f"of ppo.minibatch_size={p.minibatch_size}: change one of them")
    require(not (p.kl_in == "loss" and p.kl_estimator == "k1"),
            "ppo.kl_in=loss with ppo.kl_estimator=k1: k1's gradient is zero in expectation; set ppo.kl_estimator=k3 "
            "(as GRPO) or k2")
    require(p.ptx_coef >= 0, f"ppo.ptx_coef={p.ptx_coef} must be >= 0")
    require(p.ptx_coef == 0 or cfg.parallel.pp == 1, f"ppo.ptx_coef={p.ptx_coef} with parallel.pp={cfg.parallel.pp}: "
            "PPO-ptx micro-batches are not padded to the pipeline's fixed width yet; use parallel.pp=1 or ppo.ptx_coef=0")
    require(p.ptx_coef == 0 or p.ptx_data is not None,
            f"ppo.ptx_coef={p.ptx_coef} needs ppo.ptx_data (SFT-format rows: prompt, response)")
    require(p.ptx_data is None or paths_exist(p.ptx_data), f"ppo.ptx_data: '{p.ptx_data}' not found")


def check_ppo_layout(cfg, dp_size: int) -> None:
    """The rollout and minibatch split over data-parallel ranks and micro-batches, and the generation
    layout (`rollout` group) against the world size (one clear error)."""
    p, mbs = cfg.ppo, cfg.train.micro_batch_size
    if p.rollout_batch_size % dp_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={p.rollout_batch_size} prompts do not split over {dp_size} data-parallel ranks "
            "(each rank samples whole groups of its own prompts): make it a multiple of the data-parallel size")
    if p.minibatch_size % (dp_size * mbs):
        raise ConfigError(
            f"ppo.minibatch_size={p.minibatch_size} is not divisible by data-parallel size * train.micro_batch_size "
            f"= {dp_size}*{mbs}: change one of them")
    if cfg.parallel.cp > 1:
        raise ConfigError(
            f"the PPO stage supports tp (with sequence parallelism), pp (and vpp) and dp; got parallel.cp="
            f"{cfg.parallel.cp}: use cp=1")
    from megatron_rlhf.config.rollout import check_rollout

    # Generation runs in its own tp-only layout (rollout/hybrid.py), so any pp trains.
    world = dp_size * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    check_rollout(cfg, world)
