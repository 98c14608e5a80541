"""Stage 3, PPO (`megatron-rlhf ppo`): InstructGPT's RL stage against a frozen reward model.

One iteration, each phase timed as time/<phase>:
    1. rollout     ppo.rollout_batch_size prompts (split over data-parallel ranks) -> the RolloutEngine
    2-3. score     reward model, missing-EOS penalty, normalisation; old/reference logprobs, values (with
                   ppo.reward_tokenizer, time/retokenize of it renders the rows for the reward model)
    4. advantages  shaped rewards -> GAE -> whitening over all DP ranks (trainer/ppo/experience.py); or the
                   critic-free ppo.advantage_estimator grpo/rloo/remax (trainer/ppo/critic_free.py)
    5. train       ppo.epochs x minibatches: one policy step and one value step each (trainer/ppo/learn.py)
    6. after       KL controller, metrics + doctor warnings, eval, samples, checkpoint
Everything a run needs to continue bit-identically is checkpointed (models, optimizers, schedulers, KL
controller, doctor, prompt cursor, step counters); sampling draws are a function of (seed, iteration).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List

import torch

from megatron_rlhf.data import dataset as D

from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.algo.kl import AdaptiveKLController, FixedKLController
from megatron_rlhf.trainer.ppo.batch import Experience, all_gather_experience
from megatron_rlhf.data.sampler import ShardedBatchSampler
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.parallel.cpu import peak_memory_gib
from megatron_rlhf.models import packing
from megatron_rlhf.parallel import init
from megatron_rlhf.config.fields import ConfigError, load_gold_scorer
from megatron_rlhf.config.generation import GENERATION_CONFIG
from megatron_rlhf.config.ppo import rollouts_per_iteration
from megatron_rlhf.config.stage_models import check_ppo_stage
from megatron_rlhf.rollout.hybrid import make_rollout_engine
from megatron_rlhf.rollout.offload import PhaseMemory, offloaded
from megatron_rlhf.trainer.ppo import critic_free as cf
from megatron_rlhf.trainer.ppo.doctor import Doctor
from megatron_rlhf.trainer.ppo.experience import Frozen, rollout_stats, score_and_recompute
from megatron_rlhf.trainer.ppo.eval import evaluate, generate, ppo_sampling, sample_panel, summary, uniforms
from megatron_rlhf.trainer.ppo.learn import SkipGuard, TrainingDiverged, learn
from megatron_rlhf.trainer.ppo.models import build_ppo_models
from megatron_rlhf.trainer.ppo.ptx import PtxBatches
from megatron_rlhf.trainer.ppo.reward_tokens import RewardTokens, load_reward_tokenizer, prompt_sources
from megatron_rlhf.trainer.run import (
    StopFlag, append_jsonl, finished_line, generation_config, open_metrics, record_run, resume_point, save_or_stop,
    start_run, write_json,
)

NAMESPACES = ("ppo", "eval", "time", "perf", "warn")
# <run_dir>/samples.jsonl: rows {"iteration", "row" (0, 1, ... within one eval), "prompt", "response", "rm_score",
# "gold_score"}; a resumed run appends the evals after its checkpoint again (readers keep an iteration's last block)
SAMPLES_FILE = "samples.jsonl"


def run(cfg) -> int:
    """`megatron-rlhf ppo`: 0 when the run finished or saved on a stop request, 3 when it diverged."""
    try:
        fit(cfg)
    except TrainingDiverged as e:
        import sys

        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        init.destroy()
        return 3
    return 0


def fit(cfg) -> Dict[str, float]:
    """Train to `ppo.iterations` (or a stop request); returns the last eval metrics."""
    p, started = cfg.ppo, time.time()
    ctx = start_run(cfg, lambda dp: check_ppo_stage(cfg, dp))
    from megatron.core import parallel_state as ps

    dp_group, tok, log = ps.get_data_parallel_group(), ctx.tokenizer, ctx.log
    T.require_eos(tok, "PPO")
    train_prompts, eval_prompts, sources = load_prompts(cfg, tok, log)
    reward_tok = load_reward_tokenizer(cfg, sources)
    if eval_prompts and min(p.eval_prompts, len(eval_prompts)) < ctx.dp_size:  # each rank evaluates a share
        raise ConfigError(f"held-out evaluation needs a prompt per data-parallel rank: {len(eval_prompts)} in "
                          f"data.eval_path, ppo.eval_prompts={p.eval_prompts}, {ctx.dp_size} ranks; give more held-out "
                          "prompts, raise ppo.eval_prompts, or unset data.eval_path")
    sampler = ShardedBatchSampler(len(train_prompts), p.rollout_batch_size, ctx.dp_rank, ctx.dp_size, seed=cfg.data.seed,
                                  key="ppo.rollout_batch_size")
    steps_per_iteration = p.epochs * (rollouts_per_iteration(p) // p.minibatch_size)
    m = build_ppo_models(cfg, ctx, p.iterations * steps_per_iteration, reward_tokenizer=reward_tok)
    vocab = ctx.model_cfg.vocab_size
    reward_rows = None
    if reward_tok is not None:
        limit = m.reward_arch.max_position_embeddings
        reward_rows = RewardTokens(tok, reward_tok, cfg.data, sources, limit)
    frozen = Frozen(vocab, p.temperature, m.reward_mean, m.reward_std, p.missing_eos_penalty, reward_rows)
    kl_ctl = (AdaptiveKLController(p.beta, p.adaptive_kl_target, p.adaptive_kl_gain) if p.adaptive_kl_target
              else FixedKLController(p.beta))
    doctor, gold = Doctor(p.doctor), load_gold_scorer(p.gold_scorer)
    trained = {k: t.chunks for k, t in m.trainables().items()}  # no value model when critic-free
    optimizers = {k: t.optimizer for k, t in m.trainables().items()}
    schedulers = {k: t.scheduler for k, t in m.trainables().items()}
    ptx = PtxBatches.load(cfg, tok, ctx.dp_rank, ctx.dp_size, log) if p.ptx_coef > 0 else None

    iteration, steps_done, baseline, last_eval = 0, {"policy": 0, "value": 0}, None, {}
    resume_from = resume_point(cfg, ctx)
    if resume_from is not None:
        extra = ckpt.load_checkpoint(resume_from, trained, optimizers, schedulers)
        iteration, steps_done = int(extra["step"]), dict(extra["steps_done"])
        if iteration > p.iterations:  # before record_run: the run's config.yaml keeps the iterations it ran to
            raise ConfigError(f"ppo.iterations={p.iterations} is below the iteration of the checkpoint this run "
                              f"resumes from ({resume_from}, iteration {iteration}): set ppo.iterations >= {iteration} "
                              "to train on, or choose another logging.run_dir")
        if iteration == p.iterations and log:
            log(f"{resume_from} is the end of this run ({iteration} iterations): nothing to train; "
                "rewriting summary.json and hf_policy (raise ppo.iterations to train further)")
        sampler.load_state_dict(extra["data"])
        kl_ctl.load_state_dict(extra["kl"])
        doctor.load_state_dict(extra["doctor"])
        baseline, last_eval = extra["baseline"], extra["last_eval"]
        if ptx is not None:
            ptx.load_state_dict(extra["ptx"])
        if log:
            log(f"resumed from {resume_from} at iteration {iteration}")
    record_run(cfg, ctx)

    def save(at: int) -> None:
        path = ckpt.save_checkpoint(ctx.ckpt_root, at, trained, optimizers, schedulers, {
            "data": sampler.state_dict(), "kl": kl_ctl.state_dict(), "doctor": doctor.state_dict(),
            "steps_done": steps_done, "baseline": baseline, "last_eval": last_eval,
            **({"ptx": ptx.state_dict()} if ptx is not None else {})}, keep_last=cfg.checkpoint.keep_last,
            run=ctx.run)
        metrics.write(f"checkpoint of iteration {at}: {path}")  # rank 0, above the progress bar (set below)

    engine = make_rollout_engine(cfg, ctx.model_cfg, m.policy.chunks, tok)  # rollout.tp: own layout if needed
    def evaluate_policy(at: int) -> Dict[str, float]:
        """eval/* of the policy after iteration `at`; rank 0 appends a few of its samples to samples.jsonl."""
        if not eval_prompts:
            return {}
        shown = [] if ctx.rank0 else None
        with m.frozen_on_device():
            result = evaluate(engine, m.forward_models(), frozen, eval_prompts, cfg, ctx.dp_rank, ctx.dp_size, tok,
                              gold, dp_group, samples=shown)
        if shown:
            append_jsonl(os.path.join(cfg.logging.run_dir, SAMPLES_FILE),
                         [{"iteration": at, "row": i, **r} for i, r in enumerate(shown)])
        if reward_rows is not None:
            reward_rows.take_counts()  # time/retokenize is the training rollout's
        return result

    try:  # vLLM's shutdown destroys the process groups: it comes after everything else, the last save included
        metrics = PhaseMemory(open_metrics(cfg, ctx, p.iterations, iteration, namespaces=NAMESPACES, desc="ppo"))
        guard, stop = SkipGuard(p.max_consecutive_skips, log), StopFlag()
        if baseline is None:  # iteration 0: the SFT policy, the reference point of summary.json
            baseline = last_eval = evaluate_policy(0)
            metrics.log(0, baseline)
        correction = (p.rollout_correction, p.rollout_correction_cap)
        stop_at = min(p.iterations, cfg.train.exit_at_step or p.iterations)
        saved_at = iteration if resume_from is not None else -1  # the iteration the latest checkpoint holds
        first_iteration, loop_started = iteration, time.time()
        while iteration < stop_at:
            packing.take_real_token_fraction()  # the tally of this iteration's forwards starts here
            with metrics.timer("time/iteration") as timing:
                with engine.same_weights():  # ReMax's greedy baseline reuses the rollout's copy of the weights
                    with metrics.timer("time/rollout"), offloaded([m.policy, m.value]):  # grads + optimizer state to host
                        prompt_indices = next(sampler)
                        exp = rollout(engine, train_prompts, prompt_indices, cfg, iteration, ctx.dp_rank, tok)
                    with metrics.timer("time/score"), m.frozen_on_device():
                        score_and_recompute(exp, m.forward_models(), frozen, cfg.train.micro_batch_size,
                                            old_logprobs=p.old_logprobs,
                                            max_tokens=cfg.train.max_tokens_per_micro_batch)
                        greedy = cf.remax_baseline(engine, [train_prompts[i] for i in prompt_indices], tok, m.reward,
                                                   frozen, cfg)
                    retokenized = reward_rows.take_counts() if reward_rows is not None else None
                with metrics.timer("time/advantages"):
                    group = cf.estimate(exp, cfg.ppo, kl_ctl.beta, greedy, dp_group)  # GAE, or grpo/rloo/remax
                    stats = {f"ppo/{k}": float(v) for k, v in {**rollout_stats(exp, dp_group, correction), **group}.items()}
                    batch = all_gather_experience(exp, dp_group)
                with metrics.timer("time/train"):
                    learned = learn(m.policy, m.value, batch, cfg, iteration=iteration, dp_rank=ctx.dp_rank,
                                    dp_size=ctx.dp_size, vocab_size=vocab, guard=guard, steps_done=steps_done,
                                    train_policy=iteration >= p.value_warmup_iterations, beta=kl_ctl.beta, ptx=ptx)
            iteration += 1
            if retokenized is not None:
                stats.update(retokenize_stats(retokenized, m.reward_arch.max_position_embeddings, iteration, metrics))
            stats.update({f"ppo/{k}": v for k, v in learned.items()})
            stats["ppo/beta"] = kl_ctl.beta
            kl_ctl.update(stats["ppo/kl_per_seq"])
            stats.update(perf_stats(batch, timing.seconds))
            if (p.eval_interval and iteration % p.eval_interval == 0) or iteration == p.iterations:
                last_eval = evaluate_policy(iteration)
                stats.update(last_eval)
            for warning in doctor.check(iteration, stats):
                metrics.write(f"warning: iteration {iteration}: {warning.message}")
            stats.update(doctor.counts())
            metrics.log(iteration, stats)
            if p.sample_interval and iteration % p.sample_interval == 0:
                metrics.log_text("samples", sample_panel(exp, tok, gold), step=iteration)
            done = save_or_stop(cfg, iteration, stop, save, metrics, log, unit="iteration")
            if done == "stopped":
                return last_eval
            saved_at = iteration if done == "saved" else saved_at
        if saved_at != iteration:  # not twice: the interval's save may have been this iteration's
            save(iteration)
        if iteration == p.iterations:
            finish(cfg, ctx, m, baseline, last_eval, time.time() - started)
        metrics.close()
        if log:
            log(finished_line(cfg, "iteration", first_iteration, iteration, p.iterations, time.time() - loop_started))
    finally:
        engine.close()
    init.destroy()
    return last_eval


def load_prompts(cfg, tokenizer, log) -> tuple[List[List[int]], List[List[int]], dict]:
    """Token ids of the training prompts (data.train_path) and the held-out ones (data.eval_path, may be empty), and
    with ppo.reward_tokenizer each prompt's source by its ids (reward_tokens.prompt_sources; else {})."""
    train, _ = D.load_examples("prompt", cfg.data, tokenizer, cfg.data.train_path, log)
    held_out = D.load_examples("prompt", cfg.data, tokenizer, cfg.data.eval_path, log)[0] if cfg.data.eval_path else None
    sources = prompt_sources(train, held_out) if cfg.ppo.reward_tokenizer else {}
    return list(train["prompt_ids"]), list(held_out["prompt_ids"]) if held_out is not None else [], sources


def retokenize_stats(counts: tuple, limit: int, iteration: int, metrics) -> Dict[str, float]:
    """time/retokenize and ppo/reward_truncated_fraction of this rank's rollout (reward_tokens.RewardTokens), and a
    warning when rows were cut to the reward model's positions."""
    seconds, rows, truncated = counts
    if truncated:
        metrics.write(f"warning: iteration {iteration}: {truncated} of {rows} responses with their prompts are longer "
                      f"than the reward model's {limit} positions and were cut (the prompt's start and the response "
                      "kept): shorten data.max_prompt_len or ppo.max_new_tokens")
    return {"time/retokenize": seconds, "ppo/reward_truncated_fraction": truncated / max(rows, 1)}


def rollout(engine, prompts: List[List[int]], indices: List[int], cfg, iteration: int, dp_rank: int, tokenizer) -> Experience:
    """Phase 1: this rank's share of the iteration's prompts -> sampled responses (draws from (seed, iteration)).

    With ppo.samples_per_prompt = k each prompt is sampled k times, in consecutive rows (a whole group)."""
    p = cfg.ppo
    indices = cf.group_rows(indices, p.samples_per_prompt)
    share = slice(dp_rank * len(indices), (dp_rank + 1) * len(indices))
    draws = uniforms(cfg.train.seed, iteration, share, rollouts_per_iteration(p), p.max_new_tokens)
    return generate(engine, [prompts[i] for i in indices], tokenizer, ppo_sampling(p), draws)


def perf_stats(batch: Experience, seconds: float) -> Dict[str, float]:
    """Tokens of the global rollout batch (prompt + response) per second of the iteration, peak memory, and the
    real-token fraction of this rank's scoring and training forwards (models/packing.py; the sampler's not counted)."""
    out = {"perf/peak_memory_gib": peak_memory_gib(), "perf/tokens_per_iteration": float(batch.sequence_lengths.sum())}
    if seconds:
        out["perf/tokens_per_s"] = out["perf/tokens_per_iteration"] / seconds
    fraction = packing.take_real_token_fraction()
    if fraction is not None:
        out["perf/real_token_fraction"] = fraction
    return out


def finish(cfg, ctx, m, baseline: Dict[str, float], final: Dict[str, float], seconds: float) -> None:
    """The end of a run: <run_dir>/summary.json (rank 0) and the policy in HF format (collective)."""
    run_dir = cfg.logging.run_dir
    if cfg.ppo.export_hf:
        from megatron_rlhf.checkpoint.hf import save_hf_from_model
        from megatron_rlhf.checkpoint.hf_io import copy_tokenizer_files

        out = os.path.join(run_dir, "hf_policy")
        save_hf_from_model(m.policy.chunks, ctx.model_cfg, "lm", out, overwrite=True)
        if ctx.rank0:
            copy_tokenizer_files(Path(cfg.tokenizer.path), Path(out))
            # After the tokenizer's files, which may hold the source's: transformers then samples the policy
            # as this run did and stops at the tokenizer's EOS.
            write_json(os.path.join(out, GENERATION_CONFIG), generation_config(cfg, ctx.tokenizer))
    if ctx.rank0:
        result = summary(baseline or {}, final or {}, {"iterations": cfg.ppo.iterations, "wall_seconds": seconds})
        write_json(os.path.join(run_dir, "summary.json"), result)
        ctx.log(f"summary: {result}")
