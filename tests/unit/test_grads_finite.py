"""`optim.grads_finite`: one NaN or Inf in any gradient (Megatron DDP's flat buffers or a plain module's
.grad) is found; finite gradients pass."""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.optim import wrap_ddp
from megatron_rlhf.trainer.optim import grads_finite


def _model():
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=32, max_position_embeddings=64, params_dtype="float32")
    (model,) = build_model(cfg, ParallelConfig())
    return model


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_single_bad_element_of_a_ddp_gradient_is_found(world, bad):
    (chunk,) = wrap_ddp([_model()], False)
    params = list(chunk.parameters())
    for p in params:
        p.main_grad.normal_()
    assert grads_finite([chunk])
    params[len(params) // 2].main_grad.view(-1)[3] = bad  # a parameter in the middle of the buffer
    assert not grads_finite([chunk])


def test_plain_module_gradients(world):
    model = _model()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad = None  # a parameter without a gradient is skipped
    assert grads_finite([model])
    params[-1].grad.view(-1)[0] = float("nan")
    assert not grads_finite([model])


def test_finite_gradients_whose_sum_overflows_are_finite(world):
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3e38)  # each finite; their fp32 sum is inf
    assert grads_finite([model])
