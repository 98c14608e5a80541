"""models/logprobs.py on one rank (TP=1) against torch's log_softmax; gradients by gradcheck.

TP=2 against TP=1 is tests/distributed/test_algo_distributed.py.
"""

import pytest
import torch

from megatron_rlhf.models.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy


def _logits(seed=0, b=2, s=5, v=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, dtype=dtype) * 3
    labels = torch.randint(0, v, (b, s), generator=g)
    return logits, labels


def test_matches_log_softmax_and_entropy():
    logits, labels = _logits()
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(token_logprobs(logits, labels).double(), ref.gather(-1, labels[..., None])[..., 0], atol=1e-6)
    ref_h = -(ref.exp() * ref).sum(-1)
    assert torch.allclose(token_entropy(logits).double(), ref_h, atol=1e-6)


def test_vocab_padding_is_excluded():
    true_vocab = 8
    logits, labels = _logits(1, v=11)
    labels = labels % true_vocab
    ref = torch.log_softmax(logits[..., :true_vocab], -1)
    lp = token_logprobs(logits, labels, vocab_size=true_vocab)
    assert torch.allclose(lp.double(), ref.gather(-1, labels[..., None])[..., 0], atol=1e-6)
    h = token_entropy(logits, vocab_size=true_vocab)
    assert torch.isfinite(h).all()
    assert torch.allclose(h.double(), -(ref.exp() * ref).sum(-1), atol=1e-6)


def test_temperature():
    logits, labels = _logits(2)
    ref = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(
        token_logprobs(logits, labels, temperature=0.7).double(), ref.gather(-1, labels[..., None])[..., 0], atol=1e-6
    )


@pytest.mark.parametrize("vocab_size", [None, 9])
def test_gradients(vocab_size):
    logits, labels = _logits(3, b=2, s=3, v=11)
    labels = labels % 9
    logits.requires_grad_(True)
    torch.autograd.gradcheck(lambda x: token_logprobs(x, labels, vocab_size=vocab_size, temperature=1.3), (logits,))
    torch.autograd.gradcheck(lambda x: token_entropy(x, vocab_size=vocab_size, temperature=1.3), (logits,))


def test_bf16_logits_give_fp32_results_and_grads_in_bf16():
    logits, labels = _logits(4, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    lp = token_logprobs(logits, labels)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_bad_input_is_one_clear_error():
    logits, labels = _logits()
    with pytest.raises(ValueError, match="tp_group"):
        token_logprobs(logits, labels, vocab_size=20)
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(logits, labels[:, :3])


@pytest.mark.parametrize("vocab_size,temperature,dtype", [(None, 1.0, torch.float64), (8, 0.7, torch.float64),
                                                          (None, 1.3, torch.bfloat16)])
def test_fused_logprobs_and_entropy_equal_the_separate_ones(vocab_size, temperature, dtype):
    logits, labels = _logits(4, v=11, dtype=dtype)
    labels = labels % (vocab_size or 11)
    lp, h = token_logprobs_and_entropy(logits, labels, vocab_size=vocab_size, temperature=temperature)
    assert torch.equal(lp, token_logprobs(logits, labels, vocab_size=vocab_size, temperature=temperature))
    assert torch.allclose(h, token_entropy(logits, vocab_size=vocab_size, temperature=temperature), atol=1e-6)
    assert lp.dtype == h.dtype == torch.promote_types(dtype, torch.float32)
    x = logits.double().requires_grad_()
    lp, h = token_logprobs_and_entropy(x, labels, vocab_size=vocab_size, temperature=temperature)
    assert lp.requires_grad and not h.requires_grad  # the entropy is a diagnostic: no graph
    torch.autograd.gradcheck(lambda y: token_logprobs_and_entropy(y, labels, vocab_size=vocab_size,
                                                                  temperature=temperature)[0], (x,))


def test_pick_rows_picks_the_predicting_positions():
    from megatron_rlhf.models.logit_rows import pick_rows

    out = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 1, 2], [3, 4, 6], [6, 6, 6]])
    got = pick_rows(out, index)
    want = out.gather(1, index.unsqueeze(-1).expand(-1, -1, 5))
    assert torch.equal(got, want)
    torch.autograd.gradcheck(lambda y: pick_rows(y, index), (out,))


def test_row_blocks_give_the_same_values_and_gradients(monkeypatch):
    """The kernel works on blocks of rows (CHUNK_BYTES): many small blocks equal log_softmax and pass gradcheck."""
    from megatron_rlhf.models import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 3 * 4 * 11)  # 3 rows of 11 logits per block: 4 blocks for 10 rows
    logits, labels = _logits(5, v=11)
    ref = torch.log_softmax(logits / 0.8, -1)
    lp, h = token_logprobs_and_entropy(logits, labels, temperature=0.8)
    assert torch.allclose(lp, ref.gather(-1, labels[..., None])[..., 0], atol=1e-10)
    assert torch.allclose(h, -(ref.exp() * ref).sum(-1), atol=1e-10)
    x = logits.clone().requires_grad_()
    torch.autograd.gradcheck(lambda y: token_logprobs(y, labels, vocab_size=9, temperature=0.8), (x,))
