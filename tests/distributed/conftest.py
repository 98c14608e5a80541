"""Fixtures shared by the distributed test modules."""

import json
import random

import pytest

from megatron_rlhf.tasks import sort_digits
from tests.distributed.launch import ROOT, STARTED_JOBS, torchrun

CLI = ROOT / "megatron_rlhf" / "cli.py"
MODEL = {"model.num_layers": 2, "model.hidden_size": 64, "model.ffn_hidden_size": 128, "model.num_attention_heads": 4,
         "model.num_query_groups": 2, "model.vocab_size": 17, "model.max_position_embeddings": 32}


def _args(d: dict):
    return [f"{k}={v}" for k, v in d.items()]


# Session scope: PPO (test_ppo.py) and DPO (test_dpo.py) start from the same SFT policy and pairs.
@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The tiny pipeline at reduced size: data, an SFT policy (250 steps), pairs of its own samples labelled by
    the true score, and a calibrated RM (96 steps) trained on them."""
    d = tmp_path_factory.mktemp("ppo_base")
    sort_digits.save_tokenizer(str(d / "tokenizer"))
    rng = random.Random(0)
    write = lambda name, rows: (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    write("sft.jsonl", sort_digits.demonstrations(2048, rng))
    write("prompts.jsonl", sort_digits.prompts(1024, rng))
    write("prompts_eval.jsonl", sort_digits.prompts(128, rng))
    common = {**MODEL, "tokenizer.path": d / "tokenizer", "data.max_seq_len": 24, "data.overlong": "drop",
              "logging.progress_bar": "false", "train.seed": 0}
    torchrun(CLI, "sft", *_args({**common, "data.train_path": d / "sft.jsonl", "train.lr": 3e-3,
                                 "train.min_lr": 3e-4, "train.warmup_steps": 20, "train.global_batch_size": 64,
                                 "train.micro_batch_size": 32, "train.train_steps": 250,
                                 "logging.run_dir": d / "sft"}), nproc=2, timeout=600)
    # The RM learns from pairs of the SFT policy's own samples (labelled by the true score), as in run.sh.
    torchrun(CLI, "tiny-pairs", "--policy", d / "sft" / "checkpoints", "--prompts", d / "prompts.jsonl",
             "--tokenizer", d / "tokenizer", "--num-pairs", 3072, "--out", d / "pairs.jsonl", "--sharpness", 1e9,
             nproc=2, timeout=600)
    torchrun(CLI, "rm", *_args({**common, "model.load": d / "sft" / "checkpoints", "data.train_path": d / "pairs.jsonl",
                                "train.lr": 1e-3, "train.min_lr": 1e-4, "train.global_batch_size": 64,
                                "train.micro_batch_size": 32, "train.epochs": 2, "logging.run_dir": d / "rm",
                                "calibration.prompts_path": d / "prompts.jsonl", "calibration.num_prompts": 128,
                                "calibration.max_new_tokens": 11}), nproc=2, timeout=600)
    return d


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """A test that fails before its job ends must not leave ranks training on (they would slow every later test)."""
    yield
    while STARTED_JOBS:
        STARTED_JOBS.pop().kill_all()
