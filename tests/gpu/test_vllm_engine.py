"""The colocated vLLM engine against the Megatron sampler on one GPU (skipped without CUDA and vllm).

The CPU build runs the same engine in tests/distributed/test_vllm_engine.py; this one covers what only CUDA
has (sleep mode, the training weights leaving the device while vLLM decodes). Run on a GPU node:
`pytest tests/gpu/test_vllm_engine.py`. On a tiny bf16 model: greedy tokens equal the Megatron engine's; after a weight change the output follows the new
weights; mean |rho - 1| (trainer log-prob vs vLLM's) below 0.01 on sampled tokens.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vllm")
VOCAB, T = 256, 8


def _prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 3]
    ids = torch.zeros(len(lengths), 7, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 7 - n:] = torch.randint(1, VOCAB, (n,), generator=g)
    mask = torch.arange(7).unsqueeze(0) >= (7 - torch.tensor(lengths)).unsqueeze(1)
    return ids, mask


def test_vllm_engine_follows_the_megatron_policy(world_of_one, tmp_path):
    from megatron_rlhf.trainer.ppo.batch import build_experience
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.models.spec import ModelConfig
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from megatron_rlhf.rollout.base import SamplingParams
    from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine
    from megatron_rlhf.trainer.ppo.experience import forward_collect, response_logprobs

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=128, params_dtype="bfloat16", init_method_std=0.1)
    init.initialize(ParallelConfig(), seed=0)
    chunks = [c.cuda() for c in build_model(cfg, ParallelConfig())]
    megatron = MegatronRolloutEngine(chunks, eos_id=None, pad_id=0, vocab_size=VOCAB)
    vllm = VLLMRolloutEngine(chunks, cfg, 1, str(tmp_path / "run"), eos_id=None, pad_id=0, seed=0)
    ids, mask = _prompts()
    greedy = SamplingParams(T, greedy=True)
    before = vllm.generate(ids, mask, greedy)["response_ids"].cpu()
    assert torch.equal(before, megatron.generate(ids.cuda(), mask.cuda(), greedy)["response_ids"].cpu())

    with torch.no_grad():  # a weight change, as an optimizer step would make
        for p in chunks[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = vllm.generate(ids, mask, greedy)["response_ids"].cpu()
    assert torch.equal(after, megatron.generate(ids.cuda(), mask.cuda(), greedy)["response_ids"].cpu())
    assert not torch.equal(after, before)

    sampled = vllm.generate(ids, mask, SamplingParams(T, 1.0))
    rows = [r[m].tolist() for r, m in zip(ids, mask)]
    exp = build_experience(rows, sampled, pad_id=0)
    mbs = exp.microbatches(len(rows))
    trainer = torch.cat(forward_collect(chunks, mbs, lambda o, mb: response_logprobs(o, mb, VOCAB, 1.0))).cpu()
    m = exp.response_mask
    rho = torch.exp((trainer - exp.sampler_logprobs) * m)
    assert float(((rho - 1).abs() * m).sum() / m.sum()) < 0.01
    vllm.close()
