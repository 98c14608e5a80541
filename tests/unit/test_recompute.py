"""parallel.recompute reaches Megatron: gradients with selective or full activation recompute equal those
without (recompute trades compute for memory, never results)."""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig, transformer_config
from megatron_rlhf.parallel.layout import ParallelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                    vocab_size=64, max_position_embeddings=32)


def _grads(recompute):
    torch.manual_seed(0)
    (model,) = build_model(MODEL, ParallelConfig(recompute=recompute))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    model(ids, pos, None, labels=ids).float().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_config_mapping():
    assert transformer_config(MODEL, ParallelConfig(recompute="selective")).recompute_granularity == "selective"
    full = transformer_config(MODEL, ParallelConfig(recompute="full"))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert transformer_config(MODEL, ParallelConfig()).recompute_granularity is None


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(world, recompute):  # noqa: F811
    ref, got = _grads(None), _grads(recompute)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
