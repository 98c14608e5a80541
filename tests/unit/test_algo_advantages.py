"""GAE against a plain Python reference on random ragged batches; padding invariance; group baselines."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rlhf.algo.advantages import gae, group_advantages


def reference_gae(rewards, values, gamma, lam):
    """One row's real tokens as Python lists, exactly as the spec writes it."""
    T = len(rewards)
    adv, last = [0.0] * T, 0.0
    for t in reversed(range(T)):
        next_v = values[t + 1] if t + 1 < T else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
pad_values = finite | st.sampled_from([math.inf, -math.inf, math.nan])
# One row: (rewards, values) of the same random length 0..7.
row = st.integers(0, 7).flatmap(
    lambda n: st.tuples(st.lists(finite, min_size=n, max_size=n), st.lists(finite, min_size=n, max_size=n))
)


def _pad(rows, T, pad_value):
    B = len(rows)
    r = torch.full((B, T), pad_value, dtype=torch.float64)
    v = torch.full((B, T), pad_value, dtype=torch.float64)
    m = torch.zeros((B, T), dtype=torch.float64)
    for b, (rr, vv) in enumerate(rows):
        n = len(rr)
        r[b, :n] = torch.tensor(rr, dtype=torch.float64)
        v[b, :n] = torch.tensor(vv, dtype=torch.float64)
        m[b, :n] = 1.0
    return r, v, m


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(row, min_size=1, max_size=5),
    extra_pad=st.integers(0, 3),
    pad_value=pad_values,
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_matches_reference_loop(rows, extra_pad, pad_value, gamma, lam):
    T = max(len(r) for r, _ in rows) + extra_pad
    if T == 0:
        return
    rewards, values, mask = _pad(rows, T, pad_value)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for b, (rr, vv) in enumerate(rows):
        exp_adv, exp_ret = reference_gae(rr, vv, gamma, lam)
        n = len(rr)
        assert adv[b, :n].tolist() == pytest.approx(exp_adv, abs=1e-9)
        assert ret[b, :n].tolist() == pytest.approx(exp_ret, abs=1e-9)
        assert torch.all(adv[b, n:] == 0) and torch.all(ret[b, n:] == 0)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(row.filter(lambda x: len(x[0]) > 0), min_size=1, max_size=4), pad_a=pad_values, pad_b=pad_values)
def test_padding_values_never_change_results(rows, pad_a, pad_b):
    T = max(len(r) for r, _ in rows) + 2
    a = gae(*_pad(rows, T, pad_a))
    b = gae(*_pad(rows, T, pad_b))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Extra padding columns do not change the real part either.
    c = gae(*_pad(rows, T + 3, pad_a))
    assert torch.equal(a[0], c[0][:, :T]) and torch.equal(a[1], c[1][:, :T])


def test_gamma1_lam1_is_return_to_go_minus_value():
    torch.manual_seed(0)
    B, T = 4, 9
    rewards, values = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    lengths = torch.tensor([9, 5, 1, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    rtg = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])  # sum_{t' >= t} r_t'
    assert torch.allclose(adv, (rtg - values) * mask)
    assert torch.allclose(ret, rtg * mask)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must all be"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_group_advantages_grpo_and_rloo():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 8.0], dtype=torch.float64)
    grpo = group_advantages(scores, group_size=4, kind="grpo")
    for g in range(2):
        s = scores[4 * g : 4 * g + 4]
        mean = sum(s.tolist()) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in s.tolist()) / 3)
        assert grpo[4 * g : 4 * g + 4].tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in s.tolist()])
    rloo = group_advantages(scores, group_size=4, kind="rloo")
    expected = []
    for g in range(2):
        s = scores[4 * g : 4 * g + 4].tolist()
        expected += [s[i] - (sum(s) - s[i]) / 3 for i in range(4)]
    assert rloo.tolist() == pytest.approx(expected)
    # A group of identical scores carries no signal.
    assert torch.all(group_advantages(torch.ones(6), 3, "grpo") == 0)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="unknown kind"):
        group_advantages(torch.zeros(8), 4, kind="ppo")
