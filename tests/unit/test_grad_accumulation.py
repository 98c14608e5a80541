"""parallel/cpu.py `fuse_grad_accumulation`: the linear layers of a DDP-wrapped chunk add their weight
gradients straight into DDP's buffer, and the buffer ends up as the unfused path leaves it: over two
microbatches, with tied embeddings (whose output-layer product and embedding gradient meet in one buffer),
in fp32 and bf16. In bf16 the layers' products are the same tensors either way (equal to the bit); the
tied weight's two gradients are summed in bf16 before the hook's add on the unfused path, in the fp32
buffer on the fused one (one bf16 rounding apart)."""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.optim import wrap_ddp

VOCAB = 61


def _wrapped(dtype, fused):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, tie_embeddings=True, params_dtype=dtype)
    torch.manual_seed(0)
    (chunk,) = wrap_ddp(build_model(cfg, ParallelConfig()), use_distributed_optimizer=False)
    linears = [m for m in chunk.modules() if hasattr(m, "gradient_accumulation_fusion")]
    assert linears and all(m.gradient_accumulation_fusion for m in linears)  # wrap_ddp switched it on
    if not fused:
        for m in linears:
            m.gradient_accumulation_fusion = False
    return chunk


def _main_grads(chunk):
    g = torch.Generator().manual_seed(1)
    chunk.zero_grad_buffer()
    for _ in range(2):  # two microbatches accumulate
        ids = torch.randint(0, VOCAB, (3, 7), generator=g)
        pos = torch.arange(7).unsqueeze(0).expand(3, 7)
        logits = chunk(ids, pos, attention_mask=None)
        (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()
    return {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_accumulation_matches_the_hook_path(world, dtype):
    fused, plain = _main_grads(_wrapped(dtype, True)), _main_grads(_wrapped(dtype, False))
    assert fused.keys() == plain.keys()
    tied = "embedding.word_embeddings.weight"
    assert tied in fused
    for name in fused:
        assert fused[name].abs().sum() > 0, name
        if dtype == "float32":
            assert torch.allclose(fused[name], plain[name], atol=1e-5, rtol=1e-5), name
        elif name == tied:
            ulp = plain[name].abs().max().item() * 2.0 ** -7  # one bf16 step at the largest entry
            assert (fused[name] - plain[name]).abs().max() <= ulp, name
        else:
            assert torch.equal(fused[name], plain[name]), name
