"""A 2-iteration PPO run on CUDA (skipped without it): SFT -> RM -> PPO through the CLI on one GPU, then PPO again
with the reference and reward models in a layout of their own (`ppo.inference_tp=1`).

Run on a GPU node: `pytest tests/gpu/test_ppo_gpu.py` (uses torchrun with one rank, NCCL, bf16).
"""

import json
import random

import pytest
import torch

from megatron_rlhf.tasks import sort_digits

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_two_ppo_iterations_on_cuda(tmp_path):
    from tests.distributed.launch import ROOT, child_env, torchrun

    cli = ROOT / "megatron_rlhf" / "cli.py"
    sort_digits.save_tokenizer(str(tmp_path / "tokenizer"))
    rng = random.Random(0)
    for name, rows in (("sft.jsonl", sort_digits.demonstrations(512, rng)), ("pairs.jsonl", sort_digits.synthetic_pairs(512, rng)),
                       ("prompts.jsonl", sort_digits.prompts(256, rng))):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
              "model.num_query_groups=2", "model.vocab_size=17", "model.max_position_embeddings=32",
              "model.params_dtype=bfloat16", f"tokenizer.path={tmp_path / 'tokenizer'}", "data.max_seq_len=24",
              "logging.progress_bar=false"]
    env = {k: v for k, v in child_env().items() if k == "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    torchrun(cli, "sft", *common, f"data.train_path={tmp_path / 'sft.jsonl'}", "train.train_steps=20",
             "train.global_batch_size=32", "train.micro_batch_size=16", f"logging.run_dir={tmp_path / 'sft'}",
             nproc=1, env=env)
    torchrun(cli, "rm", *common, f"model.load={tmp_path / 'sft' / 'checkpoints'}", f"data.train_path={tmp_path / 'pairs.jsonl'}",
             "train.train_steps=10", "train.global_batch_size=32", "train.micro_batch_size=16",
             f"calibration.prompts_path={tmp_path / 'prompts.jsonl'}", "calibration.num_prompts=32",
             "calibration.max_new_tokens=11", f"logging.run_dir={tmp_path / 'rm'}", nproc=1, env=env)
    ppo = [*common, f"model.load={tmp_path / 'sft' / 'checkpoints'}", f"data.train_path={tmp_path / 'prompts.jsonl'}",
           f"data.eval_path={tmp_path / 'prompts.jsonl'}", "data.max_prompt_len=12",
           f"ppo.reward_load={tmp_path / 'rm' / 'checkpoints'}", "ppo.iterations=2", "ppo.rollout_batch_size=32",
           "ppo.minibatch_size=16", "train.micro_batch_size=16", "ppo.max_new_tokens=11", "ppo.eval_prompts=32",
           "ppo.gold_scorer=megatron_rlhf.tasks.sort_digits:gold_scores"]
    torchrun(cli, "ppo", *ppo, "ppo.offload_frozen=true", f"logging.run_dir={tmp_path / 'ppo'}", nproc=1, env=env)
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["true_reward_ppo"] is not None
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["ppo/kl_per_seq"] == pytest.approx(0.0, abs=1e-3)  # bf16: policy == reference at iteration 1
    assert rows[-1]["perf/peak_memory_gib"] > 0
    # Reference and reward in a layout of their own (built on the GPU without drawing, then loaded): the first
    # rollout is the same, and so are its scores.
    torchrun(cli, "ppo", *ppo, "ppo.inference_tp=1", f"logging.run_dir={tmp_path / 'ppo_inference_tp'}",
             nproc=1, env=env)
    own = [json.loads(line) for line in (tmp_path / "ppo_inference_tp" / "metrics.jsonl").read_text().splitlines()]
    assert own[1]["ppo/kl_per_seq"] == pytest.approx(0.0, abs=1e-3)
    assert own[1]["ppo/rm_score"] == pytest.approx(rows[1]["ppo/rm_score"], rel=1e-2, abs=1e-2)
