"""parallel/cpu.py `fuse_grad_accumulation`: the fp32 linear layers of a DDP-wrapped chunk, the output layer
that uses the tied embedding among them, add their weight gradients straight into DDP's buffer, and the
embedding lookup adds its gradient rows into it; the buffer ends up as the unfused path leaves it, over two
microbatches. bf16 linear layers keep the unfused path; their embedding lookup still goes into the buffer."""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.optim import wrap_ddp

VOCAB = 61


def _wrapped(dtype="float32", fused=True):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, tie_embeddings=True, params_dtype=dtype)
    torch.manual_seed(0)
    (chunk,) = wrap_ddp(build_model(cfg, ParallelConfig()), use_distributed_optimizer=False)
    linears = [m for m in chunk.modules() if hasattr(m, "gradient_accumulation_fusion")]  # the output layer too
    embedding = chunk.module.embedding.word_embeddings.weight
    if not fused:
        for m in linears:
            m.gradient_accumulation_fusion = False
        embedding.lookup_into_main_grad = False
    return chunk, linears, embedding


def _main_grads(chunk):
    g = torch.Generator().manual_seed(1)
    chunk.zero_grad_buffer()
    for _ in range(2):  # two microbatches accumulate
        ids = torch.randint(0, VOCAB, (3, 7), generator=g)
        pos = torch.arange(7).unsqueeze(0).expand(3, 7)
        logits = chunk(ids, pos, attention_mask=None)
        (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()
    return {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()}


def test_fused_accumulation_matches_the_hook_path(world):
    (fused_chunk, linears, embedding), (plain_chunk, *_) = _wrapped(fused=True), _wrapped(fused=False)
    assert chunk_output_layer(fused_chunk).weight is None  # tied: it multiplies by the embedding's weight
    # qkv, proj, fc1, fc2 x 2 layers, and the output layer
    assert len(linears) == 9 and all(m.gradient_accumulation_fusion for m in linears)
    assert embedding.lookup_into_main_grad
    assert embedding.zero_out_wgrad is False  # no zeroed [V, H] dummy gradient for the output layer to add
    fused, plain = _main_grads(fused_chunk), _main_grads(plain_chunk)
    assert fused.keys() == plain.keys() and "embedding.word_embeddings.weight" in fused
    for name in fused:
        assert fused[name].abs().sum() > 0, name
        assert torch.allclose(fused[name], plain[name], atol=1e-5, rtol=1e-5), name
    assert embedding.grad is None  # every gradient went into the buffer; none was left on the parameter


def test_a_dense_lookup_of_a_weight_that_writes_the_buffer_is_refused(world):
    from megatron.core.tensor_parallel import layers

    chunk, _, embedding = _wrapped()
    with torch.no_grad():  # no gradient, nothing to lose: torch's own lookup
        assert layers.F.embedding(torch.tensor([[1, 2]]), embedding, padding_idx=0).shape == (1, 2, 32)
    with pytest.raises(RuntimeError, match="VocabParallelEmbedding changed"):  # its gradient would be lost
        layers.F.embedding(torch.tensor([[1, 2]]), embedding, padding_idx=0)


def test_bf16_layers_keep_the_unfused_path(world):
    (chunk, linears, embedding), (plain_chunk, *_) = _wrapped("bfloat16"), _wrapped("bfloat16", fused=False)
    assert linears and not any(m.gradient_accumulation_fusion for m in linears)
    assert embedding.lookup_into_main_grad  # the lookup's rows go into the fp32 buffer in any dtype
    fused, plain = _main_grads(chunk), _main_grads(plain_chunk)
    for name in fused:  # the plain path sums a token's rows and the output layer's gradient in bf16 first:
        assert fused[name].abs().sum() > 0, name  # they differ by bf16 roundings (2^-8 each) of the largest
        assert (fused[name] - plain[name]).abs().max() <= 2**-7 * plain[name].abs().max(), name


def chunk_output_layer(chunk):
    return chunk.module.output_layer
