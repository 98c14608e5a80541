"""Token logprobs and entropy from TP=2 vocab-parallel logits equal the TP=1 values.

Usage: torchrun --nproc_per_node 2 algo_logprobs_tp.py OUT.json
Two sources of sharded logits: (1) a full logits tensor built from a seed on every rank and sliced
the way Megatron splits the vocabulary (including padded vocabularies, one where a whole shard is
padding), with gradients compared too; (2) a real tiny GPTModel at TP=2 whose full logits are
all-gathered for the TP=1 computation. Rank 0 writes the worst differences of both ranks.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.models.logprobs import token_entropy, token_logprobs
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig

# (true vocab, padded vocab): no padding, some padding, rank 1's shard entirely padding.
VOCABS = [(40, 40), (37, 40), (17, 40)]


def sliced_case(true_vocab, padded_vocab, tp_group):
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    g = torch.Generator().manual_seed(true_vocab)
    full = torch.randn(3, 6, padded_vocab, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, true_vocab, (3, 6), generator=g)
    w_lp, w_h = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    width = padded_vocab // tp

    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp2 = token_logprobs(shard, labels, tp_group, vocab_size=true_vocab)
    h2 = token_entropy(shard, tp_group, vocab_size=true_vocab)
    ((lp2 * w_lp).sum() + (h2 * w_h).sum()).backward()

    whole = full.clone().requires_grad_(True)
    lp1 = token_logprobs(whole, labels, vocab_size=true_vocab)
    h1 = token_entropy(whole, vocab_size=true_vocab)
    ((lp1 * w_lp).sum() + (h1 * w_h).sum()).backward()

    ref = torch.log_softmax(full[..., :true_vocab], -1)
    return {
        "logprobs_tp2_vs_tp1": (lp2 - lp1).abs().max().item(),
        "entropy_tp2_vs_tp1": (h2 - h1).abs().max().item(),
        "grad_tp2_vs_tp1": (shard.grad - whole.grad[..., rank * width : (rank + 1) * width]).abs().max().item(),
        "logprobs_vs_torch": (lp1 - ref.gather(-1, labels[..., None])[..., 0]).abs().max().item(),
        "entropy_vs_torch": (h1 + (ref.exp() * ref).sum(-1)).abs().max().item(),
    }


def gpt_case(tp_group):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.models.spec import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=4, vocab_size=61, max_position_embeddings=32)
    (model,) = build_model(cfg, ParallelConfig(tp=2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        shard = model(ids, pos, attention_mask=None).double()  # [b, s, padded_vocab / 2]
        full = gather_from_tensor_model_parallel_region(shard)  # [b, s, padded_vocab]
    labels = torch.roll(ids, -1, dims=1)
    lp2 = token_logprobs(shard, labels, tp_group, vocab_size=cfg.vocab_size)
    lp1 = token_logprobs(full, labels, vocab_size=cfg.vocab_size)
    h2 = token_entropy(shard, tp_group, vocab_size=cfg.vocab_size)
    h1 = token_entropy(full, vocab_size=cfg.vocab_size)
    return {
        "shard_width": shard.shape[-1],
        "logprobs_tp2_vs_tp1": (lp2 - lp1).abs().max().item(),
        "entropy_tp2_vs_tp1": (h2 - h1).abs().max().item(),
    }


def main(out_path):
    from megatron.core import parallel_state

    init.initialize(ParallelConfig(tp=2), seed=1234)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    result = {f"sliced_{v}_{p}": sliced_case(v, p, tp_group) for v, p in VOCABS}
    result["gpt"] = gpt_case(tp_group)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    init.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
