"""Stage 3 end to end on CPU (torchrun, gloo): PPO from a real SFT and RM of the tiny task.

The session fixture `base` (conftest.py) trains a small SFT policy and a reward model through the CLI;
the tests then run `megatron-rlhf ppo` on them: the true (gold) reward rises, iteration 1 is exact
(KL 0, ratio 1), exact resume, TP=2 and PP=2 against TP=1 x DP=2, NaN steps skipped / K in a row stop,
and GRPO with PPO-ptx at DP=2 (whole groups, no value model, exact resume).
"""

import json
import os
import re

import pytest

from megatron_rlhf.report.runs import read_samples
from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import CLI, torchrun



def _args(d: dict):
    return [f"{k}={v}" for k, v in d.items()]


def ppo_args(base, run_dir, **extra):
    settings = {
        "model.load": base / "sft" / "checkpoints", "tokenizer.path": base / "tokenizer",
        "data.train_path": base / "prompts.jsonl", "data.eval_path": base / "prompts_eval.jsonl",
        "data.max_seq_len": 24, "data.max_prompt_len": 12,
        "train.lr": 1e-4, "train.lr_schedule": "constant", "train.micro_batch_size": 16, "train.seed": 1,
        "ppo.reward_load": base / "rm" / "checkpoints", "ppo.iterations": 4, "ppo.rollout_batch_size": 64,
        "ppo.minibatch_size": 32, "ppo.epochs": 2, "ppo.max_new_tokens": 11, "ppo.eval_interval": 2,
        "ppo.eval_prompts": 64, "ppo.gold_scorer": "megatron_rlhf.tasks.sort_digits:gold_scores",
        "ppo.sample_interval": 2, "checkpoint.save_interval": 2, "logging.run_dir": run_dir,
        "logging.progress_bar": "false",
    }
    settings.update(extra)
    return ["ppo", *_args(settings)]


def rows(run_dir):
    """{iteration: metrics row}; a resumed run appends to the same file, the last row per step wins."""
    return {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def learning_metrics(row):
    return {k: v for k, v in row.items() if k.split("/")[0] in ("ppo", "eval", "warn")}


# All 128 held-out prompts: with 64 the sampled true reward moved by +-0.03 from sampling noise alone.
LEARNING = {"ppo.iterations": 14, "ppo.eval_interval": 7, "checkpoint.save_interval": 0, "ppo.eval_prompts": 128,
            "train.lr": 2e-4}


def run_and_check_learning(base, run, **extra) -> dict:
    """14 PPO iterations from `base` (test_ppo_vllm.py runs them with vLLM): the RM and true rewards rise, KL
    stays bounded. Returns iteration 1's metrics row."""
    proc = torchrun(CLI, *ppo_args(base, run, **extra, **LEARNING), nproc=2, timeout=900)
    # What the run trained, and where it wrote it (vLLM's shutdown may still log after it).
    assert re.search(rf"^ppo: trained iterations 1-14 of 14 in [0-9.]+ s; run directory {re.escape(str(run))}$",
                     proc.stdout, re.M), proc.stdout[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    for key in ("true_reward_sft", "true_reward_ppo", "rm_reward_sft", "rm_reward_ppo", "kl_ppo"):
        assert summary[key] is not None, key
    assert summary["rm_reward_ppo"] > summary["rm_reward_sft"] + 0.2, summary
    # Measured (this fixture, seed 1): sampled 0.683 -> 0.745, greedy 0.761 -> 0.903.
    assert summary["true_reward_ppo"] > summary["true_reward_sft"] + 0.02, summary
    assert summary["greedy_true_reward_ppo"] > summary["greedy_true_reward_sft"] + 0.05, summary
    assert 0 < summary["kl_ppo"] < 10, summary
    return rows(run)[1]


def test_ppo_raises_the_true_reward_and_iteration_one_is_exact(base, tmp_path):
    run = tmp_path / "ppo"
    first = run_and_check_learning(base, run)
    # Before any update the policy IS the reference: KL exactly 0, PPO ratio exactly 1. The sampler's
    # logprobs come from KV-cache decoding (other kernels): equal to ~1e-7, not to the bit.
    assert first["ppo/kl_per_seq"] == 0.0 and first["ppo/ratio_first_minibatch"] == 1.0
    assert abs(first["ppo/rho_mean"] - 1.0) < 1e-5 and first["ppo/rho_abs_dev"] < 1e-5
    for key in ("ppo/rm_score", "ppo/clip_fraction", "ppo/approx_kl", "ppo/value_explained_variance", "ppo/entropy",
                "ppo/response_length", "ppo/truncation_rate", "ppo/beta", "ppo/policy_loss", "ppo/value_loss",
                "ppo/policy_grad_norm", "ppo/value_grad_norm", "ppo/rho_max", "time/rollout", "time/train",
                "perf/tokens_per_s", "perf/peak_memory_gib", "warn/kl_blowup"):
        assert key in first, key
    # The exported policy loads in transformers and gives finite logits.
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(run / "hf_policy")
    assert torch.isfinite(hf(torch.tensor([[1, 3, 10, 8, 6]])).logits).all()


def test_exact_resume_and_tp2_match_dp2(base, tmp_path):
    """The resumed pair runs the distributed optimizer (as the 8B and 70B recipes do): policy and value save
    their optimizers' shards into one checkpoint. TP=2 (with and without sequence parallelism) and PP=2 run
    Megatron's plain optimizer."""
    straight, resumed, tp2 = tmp_path / "straight", tmp_path / "resumed", tmp_path / "tp2"
    warm = {"ppo.value_warmup_iterations": 1, "ppo.iterations": 3}  # iteration 1 trains the value model only
    distopt = {"parallel.use_distributed_optimizer": "true"}
    torchrun(CLI, *ppo_args(base, straight, **warm, **distopt), nproc=2, timeout=600)
    torchrun(CLI, *ppo_args(base, resumed, **warm, **distopt, **{"train.exit_at_step": 2}), nproc=2, timeout=600)
    assert max(rows(resumed)) == 2
    torchrun(CLI, *ppo_args(base, resumed, **warm, **distopt), nproc=2, timeout=600)
    a, b = rows(straight), rows(resumed)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in a:  # bit-identical: a fresh optimizer, scheduler, cursor or KL state would show here
        assert learning_metrics(a[step]) == learning_metrics(b[step]), step
    # The held-out samples of each eval (samples.jsonl, the run report's table) resume exactly too.
    samples = read_samples(straight / "samples.jsonl")
    assert sorted(samples) == [0, 2, 3] and samples == read_samples(resumed / "samples.jsonl")
    assert all(set(r) == {"iteration", "row", "prompt", "response", "rm_score", "gold_score"} for r in samples[3])
    assert "ppo/policy_loss" not in a[1] and "ppo/value_loss" in a[1]  # value warm-up: no policy step...
    assert a[2]["ppo/kl_per_seq"] == 0.0  # ...so iteration 2 still samples from the SFT policy
    assert a[3]["ppo/kl_per_seq"] > 0  # then the policy moved

    # A new run from this one's weights (new data or settings): policy and critic from its checkpoint, the KL
    # anchored on the SFT policy (ppo.reference_load); without it the reference would be this policy (KL 0).
    more = tmp_path / "more"
    torchrun(CLI, *ppo_args(base, more, **{
        "model.load": straight / "checkpoints", "ppo.value_load": straight / "checkpoints",
        "ppo.reference_load": base / "sft" / "checkpoints", "ppo.iterations": 1, "ppo.eval_interval": 0,
        "ppo.export_hf": "false"}), nproc=2, timeout=600)
    c = rows(more)[1]
    assert c["ppo/kl_per_seq"] > 0, c
    assert c["ppo/value_loss"] < a[1]["ppo/value_loss"], (c, a[1])  # the trained critic, not the RM's head

    torchrun(CLI, *ppo_args(base, tp2, **warm, **{"parallel.tp": 2}), nproc=2, timeout=600)
    assert_same_metrics(a, rows(tp2))
    # TP=2 with sequence parallelism (the generation copy runs without it, rollout/hybrid.py), padded: every
    # micro-batch's width rounds up to the TP size (packed, its passes are test_packing's). The same metrics.
    tp2_sp = tmp_path / "tp2_sp"
    torchrun(CLI, *ppo_args(base, tp2_sp, **warm, **{"parallel.tp": 2, "parallel.sequence_parallel": "true",
                                                    "train.packing": "false"}), nproc=2, timeout=600)
    assert_same_metrics(a, rows(tp2_sp))
    # PP=2 trains while generating at TP=1 x DP=2 (rollout/hybrid.py swaps the weights every rollout) and
    # scoring with reference and reward at ppo.inference_tp=1 (PP=1, DP=2); its first 2 iterations (value
    # warm-up, then a policy step, and an eval) match too.
    pp2 = tmp_path / "pp2"
    torchrun(CLI, *ppo_args(base, pp2, **{**warm, "parallel.pp": 2, "ppo.iterations": 2, "ppo.inference_tp": 1}),
             nproc=2, timeout=600)
    assert sorted(rows(pp2)) == [0, 1, 2]
    assert_same_metrics({step: a[step] for step in (0, 1, 2)}, rows(pp2))


def assert_same_metrics(a, c):
    for step in a:
        for key, value in learning_metrics(a[step]).items():
            # Same draws, same minibatches; only fp32 summation order differs (TP splits the matmuls).
            # Clip fractions count tokens on either side of a threshold: one token may flip (1/700).
            tol = dict(abs=0.005) if "clip_fraction" in key else dict(rel=1e-3, abs=1e-4)
            assert c[step][key] == pytest.approx(value, **tol), (step, key)


def test_grpo_at_dp2_keeps_groups_whole_builds_no_value_model_and_mixes_ptx(base, tmp_path):
    """Critic-free GRPO (4 samples per prompt, k3 KL in the loss) with PPO-ptx on 2 data-parallel ranks. Every
    iteration the trainer checks that each group's 4 rows share one prompt (`critic_free.check_groups_whole`).
    Stopped after iteration 1 and resumed, it repeats the straight run exactly (no value model in the checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader

    run, resumed = tmp_path / "grpo", tmp_path / "grpo_resumed"
    grpo = {
        "ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4, "ppo.rollout_batch_size": 16,
        "ppo.kl_in": "loss", "ppo.kl_estimator": "k3", "ppo.whiten_advantages": "false", "ppo.ptx_coef": 0.1,
        "ppo.ptx_data": base / "sft.jsonl", "ppo.iterations": 2, "ppo.eval_interval": 0, "ppo.eval_prompts": 32,
        "checkpoint.save_interval": 1}
    straight = torchrun(CLI, *ppo_args(base, run, **grpo), nproc=2, timeout=600)
    assert [straight.stdout.count(f"checkpoint of iteration {i}:") for i in (1, 2)] == [1, 1]  # the last one once
    torchrun(CLI, *ppo_args(base, resumed, **grpo, **{"train.exit_at_step": 1}), nproc=2, timeout=600)
    assert max(rows(resumed)) == 1
    torchrun(CLI, *ppo_args(base, resumed, **grpo), nproc=2, timeout=600)
    r = rows(run)
    assert sorted(rows(resumed)) == sorted(r) == [0, 1, 2]
    for step in r:  # bit-identical: policy, its optimizer, sampler cursor, ptx cursor and KL state restored
        assert learning_metrics(rows(resumed)[step]) == learning_metrics(r[step]), step
    assert r[1]["ppo/kl_per_seq"] == 0.0 and r[1]["ppo/ratio_first_minibatch"] == 1.0  # still exact at iteration 1
    for step in (1, 2):
        assert 0 <= r[step]["ppo/group_flat_fraction"] <= 1 and r[step]["ppo/group_reward_std"] > 0
        assert r[step]["ppo/ptx_loss"] > 0 and r[step]["ppo/kl_loss_term"] >= 0
        assert not any(k.startswith("ppo/value") for k in r[step]), sorted(r[step])
    assert r[2]["ppo/kl_loss_term"] > 0
    step_dir = run / "checkpoints" / "step_00000002"
    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    assert keys and not any("value" in k for k in keys), sorted(keys)[:5]  # no value weights or optimizer state


def test_nan_steps_are_skipped_and_k_in_a_row_stop(base, tmp_path):
    run = tmp_path / "nan"
    # 4 policy steps per iteration: step 2 (iteration 1) is skipped alone; 6 and 7 (iteration 2) in a row stop.
    proc = torchrun(CLI, *ppo_args(base, run, **{"ppo.max_consecutive_skips": 2, "checkpoint.save_interval": 1}),
                    nproc=2, timeout=600, check=False, env={"MEGATRON_RLHF_INJECT_NAN": "policy:2,6,7"})
    assert proc.returncode != 0 and "(exitcode: 3)" in proc.stderr, proc.stderr[-3000:]  # torchrun reports rank exit 3
    assert "2 policy optimizer steps in a row had NaN/Inf" in proc.stderr
    assert "policy step 2: NaN/Inf in the loss or gradients; step skipped" in proc.stdout
    r = rows(run)
    assert r[1]["ppo/skipped_steps"] == 1.0 and max(r) == 1
    # The last good checkpoint is intact and is what a rerun resumes from.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_sigterm_saves_and_exits_zero(base, tmp_path):
    """Preemption as in stages 1-2: SIGTERM -> checkpoint at the end of the iteration -> exit 0 (a world of one)."""
    import sys

    from tests.distributed.launch import sigterm_when

    run = tmp_path / "preempted"
    args = ppo_args(base, run, **{"ppo.iterations": 1000, "ppo.eval_interval": 0, "checkpoint.save_interval": 0,
                                  "train.micro_batch_size": 32})
    ready = lambda: (run / "metrics.jsonl").exists() and max(rows(run)) >= 1  # noqa: E731
    rc, out = sigterm_when([sys.executable, str(CLI), *args], tmp_path / "preempted.log", ready)
    assert rc == 0, out[-3000:]
    stopped_at = max(rows(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert f"saved checkpoint at iteration {stopped_at}" in out
