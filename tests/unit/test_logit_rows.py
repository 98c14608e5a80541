"""models/logit_rows.py: inside `logits_at`, the LM forward returns the logits at the chosen rows only, equal to
those rows of the full forward, with the same gradients; the full forward's logits come back batch-major
without a copy; scalar heads and rows None are untouched; PPO's log-probs agree either way."""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.logit_rows import logits_at, pick_rows
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.ppo.experience import response_logprobs

VOCAB = 67


def _model(head="lm", tie=True):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, tie_embeddings=tie)
    torch.manual_seed(0)
    (model,) = build_model(cfg, ParallelConfig(), head=head)
    return model


def _inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    pos = torch.arange(11).unsqueeze(0).expand(3, 11)
    rows = torch.tensor([[2, 3, 4, 5], [6, 7, 8, 9], [0, 1, 1, 1]])  # [b, T]; repeated rows are allowed
    return ids, pos, rows


@pytest.mark.parametrize("tie", [True, False])
def test_rows_equal_the_full_forward_and_so_do_their_gradients(world, tie):
    model = _model(tie=tie)
    ids, pos, rows = _inputs()
    full = model(ids, pos, None)
    assert full.shape == (3, 11, VOCAB) and full.is_contiguous()
    with logits_at(model, rows):
        picked = model(ids, pos, None)
    assert picked.shape == (3, 4, VOCAB) and picked.is_contiguous()
    assert torch.allclose(picked, pick_rows(full, rows), atol=1e-6, rtol=1e-6)

    weights = torch.randn(picked.shape, generator=torch.Generator().manual_seed(5))
    grads = []
    for use_rows in (False, True):
        model.zero_grad()
        if use_rows:
            with logits_at(model, rows):
                out = model(ids, pos, None)
        else:
            out = pick_rows(model(ids, pos, None), rows)
        (out * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        assert torch.allclose(grads[1][name], g, atol=1e-5, rtol=1e-5), name


def test_rows_none_and_scalar_heads_are_untouched(world):
    ids, pos, rows = _inputs()
    lm = _model()
    with logits_at(lm, None):
        assert lm(ids, pos, None).shape == (3, 11, VOCAB)
    value = _model(head="scalar")
    with logits_at(value, rows):
        assert value(ids, pos, None).shape == (3, 11, 1)
    assert lm.output_layer.logit_rows is None  # the rows are cleared on the way out


def test_ppo_log_probs_agree_with_and_without_rows(world):
    model = _model()
    ids, pos, rows = _inputs()
    mb = {"response_index": rows, "response_ids": torch.randint(0, VOCAB, rows.shape)}
    with torch.no_grad():
        full = response_logprobs(model(ids, pos, None), mb, VOCAB, 0.7)
        with logits_at(model, rows):
            at_rows = response_logprobs(model(ids, pos, None), mb, VOCAB, 0.7)
    assert torch.allclose(full, at_rows, atol=1e-6)
