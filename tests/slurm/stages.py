"""Tiny stages for the real cluster: configs written as YAML (a job reads them from disk), a stage run locally
with `megatron-rlhf launch --nproc-per-node 2` (the reference), and the per-step metrics to compare."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from megatron_rlhf.tasks import sort_digits
from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import CLI, child_env, run_reaped
from tests.distributed.stages import overrides
from tests.slurm.cluster import write_yaml

LONG_STEPS = 60  # ~5 s of steps (a step here is ~70 ms with its logging): a stop signal lands mid-run
# Keys that depend on the machine or the clock, not on the computation.
VOLATILE = ("time/", "perf/", "wall_time")


def sft_config(data, tmp: Path, name: str, **extra) -> Path:
    """YAML of the tiny SFT stage (2 layers x 32, 17 tokens) writing to tmp/<name>."""
    return write_yaml(tmp / f"{name}.yaml", overrides(data, tmp / name, **extra))


def rm_config(data, tmp: Path, name: str, **extra) -> Path:
    return write_yaml(tmp / f"{name}.yaml", overrides(data, tmp / name, kind="rm", **extra))


def ppo_config(data, sft_ckpt: Path, rm_ckpt: Path, tmp: Path, name: str, **extra) -> Path:
    """YAML of a 2-iteration PPO run from the tiny SFT policy and RM (8 rollouts, 6 new tokens)."""
    prompts = data / "prompts.jsonl"
    if not prompts.exists():
        rows = sort_digits.prompts(64, random.Random(1))
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {
        "model.load": sft_ckpt, "tokenizer.path": data / "tokenizer", "data.train_path": prompts,
        "data.max_seq_len": 24, "data.max_prompt_len": 12, "train.lr": 1e-4, "train.lr_schedule": "constant",
        "train.micro_batch_size": 2, "train.seed": 1, "ppo.reward_load": rm_ckpt, "ppo.iterations": 2,
        "ppo.rollout_batch_size": 8, "ppo.minibatch_size": 4, "ppo.epochs": 1, "ppo.max_new_tokens": 6,
        "ppo.eval_interval": 0, "ppo.sample_interval": 0, "ppo.normalize_reward": "false", "ppo.export_hf": "false", "checkpoint.save_interval": 1,
        "logging.run_dir": tmp / name, "logging.progress_bar": "false", "logging.log_interval": 1,
    }
    values.update(extra)
    return write_yaml(tmp / f"{name}.yaml", [f"{k}={v}" for k, v in values.items()])


def run_local(stage: str, config: Path, *extra, timeout: int = 600):
    """The stage on 2 ranks of this machine through `megatron-rlhf launch` (what the Slurm job must repeat)."""
    cmd = [sys.executable, str(CLI), "launch", "--nproc-per-node", "2", stage, str(config), *extra]
    proc = run_reaped(cmd, env=child_env(), timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"local {stage} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def run_dir(config: Path) -> Path:
    from omegaconf import OmegaConf

    return Path(OmegaConf.load(config).logging.run_dir)


def step_metrics(run: Path) -> dict:
    """{step: every logged value of that step except the clock's}; a resumed run appends, the last row wins."""
    merged: dict = {}
    for row in read_jsonl(os.path.join(run, "metrics.jsonl")):
        values = {k: v for k, v in row.items() if k != "step" and not k.startswith(VOLATILE)}
        merged.setdefault(row["step"], {}).update(values)
    return merged


def assert_same_metrics(run: Path, reference: Path) -> None:
    got, want = step_metrics(run), step_metrics(reference)
    assert want, f"no metrics in {reference}"
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in want:
        assert got[step] == want[step], (step, got[step], want[step])  # bit-identical: == on floats
