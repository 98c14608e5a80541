"""checkpoint/state.py `load_model`: a model whose every weight the checkpoint writes is built without drawing
any (no random state moves; the tensor-parallel attributes are those of a drawn model) and equals the saved
one; an LM head that the source lacks is still drawn. The frozen models of `ppo.inference_tp`, built in a
layout of their own, likewise. A world of one rank, in process."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig

# Untied: the LM output layer is a weight of its own, drawn unless a checkpoint fills it.
CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=17, max_position_embeddings=32, tie_embeddings=False)


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """A checkpoint root holding a policy (LM head) and a reward model (scalar head), and those models."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    models = {"policy": build_model(CFG, ParallelConfig()), "reward": build_model(CFG, ParallelConfig(), head="scalar")}
    with torch.no_grad():
        models["reward"][0].output_layer.weight.normal_()  # a trained head, not the fresh zero one
    ckpt.save_checkpoint(root, 1, models, {}, {}, {"step": 1}, keep_last=1)
    return root, models


def _random_states():
    """The host generator's state and those of Megatron's tracker (where the GPU path draws, under a fork)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return [torch.get_rng_state()] + [s.clone() for _, s in sorted(get_cuda_rng_tracker().get_states().items())]


def _tp_attributes(chunk):
    return {n: tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim", "partition_stride"))
            for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("name, head", [("policy", "lm"), ("reward", "scalar")])
def test_a_model_the_checkpoint_fills_draws_nothing_and_equals_it(saved, name, head):
    root, models = saved
    before = _random_states()
    (chunk,) = ckpt.load_model(root, CFG, ParallelConfig(), name, head)
    assert all(torch.equal(a, b) for a, b in zip(before, _random_states()))
    source = models[name][0].state_dict()
    loaded = {k: v for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
    assert loaded and all(torch.equal(v, source[k]) for k, v in loaded.items())
    assert _tp_attributes(chunk) == _tp_attributes(build_model(CFG, ParallelConfig(), head=head)[0])


def test_an_lm_head_the_source_lacks_is_drawn(saved):
    root, models = saved
    before = _random_states()
    (chunk,) = ckpt.load_model(root, CFG, ParallelConfig(), "reward", "lm", key="model.load")
    assert not all(torch.equal(a, b) for a, b in zip(before, _random_states()))
    weight = chunk.output_layer.weight
    assert torch.isfinite(weight).all() and 0.01 < float(weight.detach().std()) < 0.04  # drawn with std 0.02
    body = models["reward"][0].state_dict()
    assert torch.equal(chunk.embedding.word_embeddings.weight, body["embedding.word_embeddings.weight"])


def test_an_inference_layout_model_draws_nothing_and_the_load_writes_every_element(world, tmp_path, monkeypatch):
    """trainer/ppo/inference_layout.py: the reference and the reward model equal the saved ones, padding rows of
    the vocabulary included, though their built weights were NaN; and no weight was drawn for them."""
    from megatron_rlhf.rollout import layout
    from megatron_rlhf.trainer.ppo import inference_layout

    padded = dataclasses.replace(CFG, make_vocab_size_divisible_by=4)  # 17 -> 20: three padding rows
    models = {"policy": build_model(padded, ParallelConfig()),
              "reward": build_model(padded, ParallelConfig(), head="scalar")}
    with torch.no_grad():
        models["reward"][0].output_layer.weight.normal_()
    ckpt.save_checkpoint(tmp_path, 1, models, {}, {}, {"step": 1}, keep_last=1)
    draws = []
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *a, **k: draws.append(tensor.shape) or tensor)

    def built_as_nan(*args, **kwargs):
        model = layout.build_in_layout(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return model

    monkeypatch.setattr(inference_layout, "build_in_layout", built_as_nan)
    for name, head in (("policy", "lm"), ("reward", "scalar")):
        model = inference_layout.build_inference_model(SimpleNamespace(parallel=ParallelConfig()), padded,
                                                       layout.tp_only_layout(1), head, tmp_path, name, 1.0).model
        source = models[name][0].state_dict()
        loaded = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        assert loaded and all(torch.equal(v, source[k]) for k, v in loaded.items()), name
        assert model.embedding.word_embeddings.weight.shape[0] == 20
    assert draws == []
