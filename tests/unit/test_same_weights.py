"""RolloutEngine.same_weights: generate calls with no optimizer step between them share one weight copy
(hybrid engine in a world of one; the copy is counted, and the output must not change)."""

import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.hybrid import HybridRolloutEngine

CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=64, max_position_embeddings=32, init_method_std=0.2)


def test_one_copy_inside_the_block_and_one_per_generate_outside(world):
    torch.manual_seed(0)
    chunks = build_model(CFG, ParallelConfig())
    engine = HybridRolloutEngine(chunks, CFG, 1, 1, eos_id=None, pad_id=0, vocab_size=CFG.vocab_size)
    copies = []
    swap = engine.swap
    engine.swap = lambda: (copies.append(1), swap())
    ids, mask = torch.randint(1, 64, (3, 5)), torch.ones(3, 5, dtype=torch.bool)
    greedy = SamplingParams(6, greedy=True)

    first = engine.generate(ids, mask, greedy)
    with engine.same_weights():
        inside = [engine.generate(ids, mask, greedy) for _ in range(3)]
        with engine.same_weights():  # nested: still the one copy
            inside.append(engine.generate(ids, mask, greedy))
    assert len(copies) == 2
    assert all(torch.equal(out["response_ids"], first["response_ids"]) for out in inside)

    with torch.no_grad():  # an optimizer step after the block: the next generate must copy again
        for p in chunks[0].parameters():
            p.mul_(-1.0)
    after = engine.generate(ids, mask, greedy)
    assert len(copies) == 3 and not torch.equal(after["logprobs"], first["logprobs"])
