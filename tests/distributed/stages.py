"""Stages 1-2 at test size: the task directory fixtures start from, the config overrides for the `data`
fixture (conftest.py) and readers of a run."""

import json
import os
import random

from megatron_rlhf.trainer.metrics import read_jsonl
from megatron_rlhf.tasks import sort_digits
from tests.distributed.launch import CLI, torchrun


def task_dir(tmp_path_factory, name: str):
    """A fresh directory holding the tiny task's tokenizer -> (directory, write(file name, rows) as jsonl,
    random.Random(0) for the rows)."""
    d = tmp_path_factory.mktemp(name)
    sort_digits.save_tokenizer(str(d / "tokenizer"))

    def write(file_name: str, rows) -> None:
        (d / file_name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    return d, write, random.Random(0)


def overrides(data, run_dir, kind="sft", **extra):
    train_file, eval_file = ("sft.jsonl", "sft_eval.jsonl") if kind == "sft" else ("pairs.jsonl", "pairs_eval.jsonl")
    base = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.ffn_hidden_size": 64,
        "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.vocab_size": 17,
        "model.max_position_embeddings": 32,
        "tokenizer.path": data / "tokenizer",
        "data.train_path": data / train_file, "data.eval_path": data / eval_file, "data.max_seq_len": 24,
        "train.lr": 2e-3 if kind == "sft" else 1e-3, "train.lr_schedule": "constant",
        "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.train_steps": 6, "train.seed": 3,
        "logging.run_dir": run_dir, "logging.progress_bar": "false", "logging.log_interval": 1,
        "checkpoint.save_interval": 2,
    }
    if kind == "rm":
        base["calibration.enabled"] = "false"
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run_cli(kind, args, nproc=1, **kw):
    return torchrun(CLI, kind, *args, nproc=nproc, **kw)


def losses(run_dir):
    """{step: train/loss}; a resumed run appends to the same file, the last row per step wins."""
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
