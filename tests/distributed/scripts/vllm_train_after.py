"""Training after a generation, with vLLM in the process or not, on the same sampled tokens (2 ranks, DP=2).

Usage: torchrun --nproc_per_node 2 vllm_train_after.py ENGINE TOKENS_DIR OUT.json RUN_DIR
ENGINE vllm: the vLLM engine samples this rank's prompts and the tokens are saved under TOKENS_DIR.
ENGINE megatron: the Megatron sampler generates (so this process decoded too), then the vLLM run's tokens
are loaded. Both then train the same policy 3 steps on those tokens, at 2 threads: minibatch order from the
global RNG, a log-likelihood loss, gradients averaged over DP, Adam. Rank 0 writes each step's loss and the
final weights' sum (float64): equal between the two runs when vLLM left the thread count and the RNG alone.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.init import destroy, initialize
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.trainer.ppo.experience import response_logprobs
from megatron_rlhf.trainer.step import position_ids_for

VOCAB, T, PAD, ROWS = 256, 10, 0, 8


def main():
    engine_name, tokens_dir, out, run_dir = sys.argv[1:5]
    initialize(ParallelConfig(), seed=0)
    rank = dist.get_rank()
    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, params_dtype="float32", init_method_std=0.05)
    (model,) = build_model(cfg, ParallelConfig(), head="lm")
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(1, VOCAB, (ROWS, 6), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    draws = torch.rand(ROWS, T, generator=g)
    sampling = SamplingParams(T, 1.0)
    path = os.path.join(tokens_dir, f"rank{rank}.pt")
    if engine_name == "vllm":
        from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine([model], cfg, 1, run_dir, eos_id=None, pad_id=PAD, seed=0)
        sampled = engine.generate(ids, mask, sampling, uniforms=draws)
        torch.save(sampled, path)
    else:
        from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

        engine = MegatronRolloutEngine([model], eos_id=None, pad_id=PAD, vocab_size=VOCAB)
        engine.generate(ids, mask, sampling, uniforms=draws)
        sampled = torch.load(path)
    exp = build_experience([r.tolist() for r in ids], sampled, pad_id=PAD)

    torch.set_num_threads(2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        order = torch.randperm(ROWS)  # the global RNG: a reseed by vLLM would show here
        optimizer.zero_grad()
        for half in order.split(ROWS // 2):
            (mb,) = exp.rows(half).microbatches(ROWS // 2)
            logits = model(mb["input_ids"], position_ids_for(mb["input_ids"]), None)
            lp = response_logprobs(logits, mb, VOCAB, 1.0)
            loss = -(lp * mb["response_mask"]).sum() / mb["response_mask"].sum()
            loss.backward()
            losses.append(float(loss))
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "weights_sum": total, "threads": torch.get_num_threads()}, f)
    engine.close()
    destroy()


if __name__ == "__main__":
    main()
