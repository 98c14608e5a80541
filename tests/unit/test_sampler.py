"""rollout/megatron_engine.py on one rank (TP=1): KV-cache decoding against full recomputation.

References are computed here without any cache, by running the model on the whole sequence at
every step: (a) the left-padded batch with an explicit mask hiding the padding columns, (b) each
prompt alone with no padding at all. TP=2 against TP=1 is tests/distributed/test_sampler_tp.py.
"""


import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout import GENERATION_KEYS, SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine, generate

VOCAB = 17
# A larger init std than the default makes next-token distributions peaked, so greedy choices are
# never near-ties that the last bit of float noise could flip.
CFG = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
           vocab_size=VOCAB, max_position_embeddings=64, init_method_std=0.2)
PAD = 0


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    (model,) = build_model(ModelConfig(**{**CFG, **overrides}), ParallelConfig())
    return model


@pytest.fixture(scope="module")
def model(world):
    return _model()


def _prompts(seed=0, lengths=(3, 1, 6, 4), extra_pad=2):
    """LEFT-padded prompts [b, s] (s = longest + extra_pad) with real ids in [1, VOCAB) and their mask."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths) + extra_pad
    ids = torch.full((len(lengths), s), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, s - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, s - n :] = True
    return ids, mask


def _gen(model, ids, mask, **kw):
    kw = {"max_new_tokens": 6, "eos_id": None, "pad_id": PAD, "vocab_size": VOCAB, **kw}
    return generate(model, ids, prompt_mask=mask, **kw)


@torch.no_grad()
def _full_logits(model, ids, mask=None):
    """No cache: next-token logits [b, s, VOCAB] of the whole sequence. With `mask` ([b, s] bool, True on
    real tokens) padding columns are hidden from every query (causal | padding mask, True = masked)."""
    model.eval()
    b, s = ids.shape
    attn = None
    if mask is not None:
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        attn = (causal.unsqueeze(0) | ~mask.unsqueeze(1)).unsqueeze(1)  # [b, 1, s, s]
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    return model(ids, pos, attn)[..., :VOCAB].float()


def _greedy_recompute_padded(model, ids, mask, n):
    """Greedy tokens [b, n] and their logprobs, recomputing the padded batch from scratch each step."""
    tokens, lps = [], []
    for _ in range(n):
        logp = torch.log_softmax(_full_logits(model, ids, mask)[:, -1], -1)
        tok = logp.argmax(-1)
        tokens.append(tok)
        lps.append(logp.gather(-1, tok[:, None])[:, 0])
        ids = torch.cat([ids, tok[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(tokens, 1), torch.stack(lps, 1)


def _greedy_recompute_alone(model, prompt, n):
    """Greedy tokens [n] of one unpadded prompt [s], recomputed from scratch each step."""
    seq = prompt.clone()
    for _ in range(n):
        seq = torch.cat([seq, _full_logits(model, seq[None])[0, -1].argmax(-1, keepdim=True)])
    return seq[len(prompt) :]


def _recomputed_logprobs(model, ids, mask, out, temperature):
    """log softmax(logits / T) at each generated token, from one no-cache forward per row
    over its unpadded prompt + response. -> [b, T] (0 on padding)."""
    result = torch.zeros_like(out["logprobs"])
    for i in range(ids.shape[0]):
        prompt = ids[i][mask[i]]
        n = int(out["lengths"][i])
        resp = out["response_ids"][i, :n]
        logits = _full_logits(model, torch.cat([prompt, resp])[None])[0]
        logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : len(prompt) - 1 + n]
        result[i, :n] = logp.gather(-1, resp[:, None])[:, 0]
    return result


def test_greedy_with_cache_equals_full_recompute_of_padded_batch(model):
    ids, mask = _prompts()
    out = _gen(model, ids, mask, greedy=True, max_new_tokens=7)
    assert set(out) == set(GENERATION_KEYS)
    ref_tokens, ref_lp = _greedy_recompute_padded(model, ids, mask, 7)
    assert torch.equal(out["response_ids"], ref_tokens)
    assert torch.allclose(out["logprobs"], ref_lp, atol=1e-5)
    assert out["response_mask"].eq(1).all() and not out["ended"].any() and out["lengths"].eq(7).all()
    # The model is not degenerate: different prompts get different continuations.
    assert len({tuple(r) for r in out["response_ids"].tolist()}) > 1


def test_padding_never_changes_the_tokens(model):
    ids, mask = _prompts(1, lengths=(5, 2, 7, 1, 3), extra_pad=3)
    out = _gen(model, ids, mask, greedy=True)
    for i in range(ids.shape[0]):
        prompt = ids[i][mask[i]]
        alone = _gen(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.bool), greedy=True)
        assert torch.equal(alone["response_ids"][0], out["response_ids"][i]), i
        assert torch.allclose(alone["logprobs"][0], out["logprobs"][i], atol=1e-5), i
        assert torch.equal(_greedy_recompute_alone(model, prompt, 6), out["response_ids"][i]), i
    # prompt_lengths is the same input as prompt_mask.
    by_len = generate(model, ids, prompt_lengths=mask.sum(-1), max_new_tokens=6, eos_id=None, pad_id=PAD,
                      vocab_size=VOCAB, greedy=True)
    assert torch.equal(by_len["response_ids"], out["response_ids"])


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_ends_rows_and_pads_after(model, pad_is_eos):
    ids, mask = _prompts(2, lengths=(4, 2, 5, 3, 6, 1), extra_pad=1)
    free = _gen(model, ids, mask, greedy=True, max_new_tokens=8)
    eos = int(free["response_ids"][0, 2])  # a token greedy decoding does produce
    pad = eos if pad_is_eos else (eos + 1) % VOCAB
    out = _gen(model, ids, mask, greedy=True, max_new_tokens=8, eos_id=eos, pad_id=pad)
    for i, row in enumerate(free["response_ids"].tolist()):
        n = row.index(eos) + 1 if eos in row else 8
        assert bool(out["ended"][i]) == (eos in row), i
        assert int(out["lengths"][i]) == n, i
        assert out["response_ids"][i, :n].tolist() == row[:n], i  # unaffected before EOS
        assert out["response_ids"][i, n:].eq(pad).all(), i
        assert out["response_mask"][i].tolist() == [1.0] * n + [0.0] * (8 - n), i
        assert out["logprobs"][i, n:].eq(0).all() and out["logprobs"][i, :n].lt(0).all(), i
        assert torch.allclose(out["logprobs"][i, :n], free["logprobs"][i, :n], atol=1e-5), i
    # Both kinds of rows occur, so both branches were checked.
    assert out["ended"].any() and not out["ended"].all()
    assert out["response_mask"].dtype == torch.float32 and out["ended"].dtype == torch.bool


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_recomputed_log_softmax(model, temperature):
    ids, mask = _prompts(3)
    out = _gen(model, ids, mask, temperature=temperature, seed=11, max_new_tokens=8, eos_id=5)
    ref = _recomputed_logprobs(model, ids, mask, out, temperature)
    assert torch.allclose(out["logprobs"], ref, atol=1e-5), (out["logprobs"] - ref).abs().max()
    # Temperature matters: the same tokens scored at another temperature differ.
    other = _recomputed_logprobs(model, ids, mask, out, temperature * 2)
    assert (other - ref).abs().max() > 1e-2


def test_seeded_sampling_is_reproducible(model):
    ids, mask = _prompts(4)
    a = _gen(model, ids, mask, seed=7, max_new_tokens=10)
    b = _gen(model, ids, mask, generator=torch.Generator().manual_seed(7), max_new_tokens=10)
    c = _gen(model, ids, mask, seed=8, max_new_tokens=10)
    for k in GENERATION_KEYS:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["response_ids"], c["response_ids"])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_frequencies_follow_softmax_and_skip_padded_vocab(world, temperature):
    # make_vocab_size_divisible_by=8 pads 17 ids to 24: ids 17..23 have (random) logits but no probability.
    model = _model(1, make_vocab_size_divisible_by=8)
    prompt = torch.tensor([[3, 9, 4]])
    n = 6000
    out = generate(model, prompt.expand(n, -1), prompt_lengths=torch.full((n,), 3), max_new_tokens=1,
                   eos_id=None, pad_id=PAD, vocab_size=VOCAB, temperature=temperature, seed=3)
    first = out["response_ids"][:, 0]
    assert first.max() < VOCAB
    freq = torch.bincount(first, minlength=VOCAB).double() / n
    probs = torch.softmax(_full_logits(model, prompt)[0, -1].double() / temperature, -1)
    assert 0.5 * (freq - probs).abs().sum() < 0.04, (freq, probs)
    assert torch.allclose(out["logprobs"][:, 0].double(), probs.log()[first], atol=1e-5)


def _truncated_reference(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The kept ids' probabilities, renormalised (zero elsewhere), by a loop over ids sorted by probability:
    the top k, then (as transformers' and vLLM's samplers do) top-p over the renormalised top k."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[: top_k or len(probs)]
    total = sum(float(probs[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i]) / total
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (4, 0.8)])
def test_top_k_and_top_p_sample_only_the_kept_ids_and_report_their_renormalised_logprobs(world, top_k, top_p):
    model = _model(1)
    prompt = torch.tensor([[3, 9, 4]])
    n = 6000
    out = generate(model, prompt.expand(n, -1), prompt_lengths=torch.full((n,), 3), max_new_tokens=1,
                   eos_id=None, pad_id=PAD, vocab_size=VOCAB, temperature=0.8, seed=3, top_k=top_k, top_p=top_p)
    first = out["response_ids"][:, 0]
    ref = _truncated_reference(torch.softmax(_full_logits(model, prompt)[0, -1].double() / 0.8, -1), top_k, top_p)
    assert 1 < int((ref > 0).sum()) < VOCAB  # the truncation keeps some ids and drops others
    assert bool((ref[first] > 0).all())  # never a dropped id
    freq = torch.bincount(first, minlength=VOCAB).double() / n
    assert 0.5 * (freq - ref).abs().sum() < 0.04, (freq, ref)
    assert torch.allclose(out["logprobs"][:, 0].double(), ref.log()[first], atol=1e-5)
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        SamplingParams(4, top_p=1.5)


def test_restores_mode_and_does_not_track_gradients(world):
    model = _model(2)
    ids, mask = _prompts(5)
    for training in (True, False):
        model.train(training)
        out = _gen(model, ids, mask, seed=0)
        assert model.training == training
        assert not any(v.requires_grad for v in out.values())


def test_ddp_wrapped_chunk_list_gives_the_same_tokens(world):
    from megatron_rlhf.trainer.optim import wrap_ddp

    model = _model(3)
    ids, mask = _prompts(6)
    plain = _gen(model, ids, mask, greedy=True)
    wrapped = wrap_ddp([model], use_distributed_optimizer=False)
    assert torch.equal(_gen(wrapped, ids, mask, greedy=True)["response_ids"], plain["response_ids"])


def test_engine_interface(model):
    ids, mask = _prompts(7)
    engine = MegatronRolloutEngine([model], eos_id=4, pad_id=PAD, vocab_size=VOCAB)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=5, temperature=0.9),
                          generator=torch.Generator().manual_seed(1))
    ref = _gen(model, ids, mask, max_new_tokens=5, temperature=0.9, eos_id=4, seed=1)
    for k in GENERATION_KEYS:
        assert torch.equal(out[k], ref[k]), k
    assert engine.shares_policy_weights
    with pytest.raises(NotImplementedError, match="own parameters"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(1))])
    engine.sleep()
    engine.wake()


def test_bad_input_is_one_clear_error(world, model):
    ids, mask = _prompts(8)
    with pytest.raises(ValueError, match="exactly one"):
        generate(model, ids, max_new_tokens=2, eos_id=None, pad_id=PAD, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="LEFT-padded"):
        _gen(model, ids, mask.flip(-1))
    with pytest.raises(ValueError, match="at least one|lengths must be in"):
        _gen(model, ids, mask & False)
    with pytest.raises(ValueError, match="temperature"):
        _gen(model, ids, mask, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _gen(model, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _gen(model, ids, mask, max_new_tokens=64)
    with pytest.raises(ValueError, match="eos_id"):
        _gen(model, ids, mask, eos_id=VOCAB)
    with pytest.raises(ValueError, match="prompt token ids"):
        _gen(model, ids + VOCAB, mask)
    with pytest.raises(NotImplementedError, match="pp=1"):
        _gen([model, model], ids, mask)
    torch.manual_seed(0)
    (scalar,) = build_model(ModelConfig(**CFG), ParallelConfig(), head="scalar")
    with pytest.raises(ValueError, match="scalar"):
        _gen(scalar, ids, mask)


def test_uniform_draws_make_each_row_independent_of_its_batch(model):
    """With `uniforms`, a row samples the same tokens alone or inside any batch (layout independence)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 6, 3]
    width = max(lengths)
    ids = torch.full((4, width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
    draws = torch.rand(4, 8, generator=g)
    kw = dict(max_new_tokens=8, eos_id=2, pad_id=PAD, vocab_size=VOCAB, temperature=1.5)
    whole = generate(model, ids, prompt_lengths=torch.tensor(lengths), uniforms=draws, **kw)
    for i in range(4):
        alone = generate(model, ids[i:i + 1, width - lengths[i]:], prompt_lengths=torch.tensor([lengths[i]]),
                         uniforms=draws[i:i + 1], **kw)
        assert alone["response_ids"][0].tolist() == whole["response_ids"][i].tolist(), i
        assert torch.allclose(alone["logprobs"][0], whole["logprobs"][i], atol=1e-5)
    # Other draws give other samples (the draws are really used), and a draw near 0 picks a likely token.
    other = generate(model, ids, prompt_lengths=torch.tensor(lengths), uniforms=torch.rand(4, 8, generator=g), **kw)
    assert other["response_ids"].tolist() != whole["response_ids"].tolist()
    with pytest.raises(ValueError, match="uniforms"):
        generate(model, ids, prompt_lengths=torch.tensor(lengths), uniforms=torch.rand(4, 7), **kw)
