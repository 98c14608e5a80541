"""data/sampler.py: the sharded, resumable training-batch sampler and the evaluation batches."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rlhf.data import dataset as D
from megatron_rlhf.data.sampler import ShardedBatchSampler, eval_batches


def take(sampler, n):
    return [next(sampler) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 200), per_rank=st.integers(1, 8), dp=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_sampler_covers_each_index_once_per_epoch_across_ranks(n, per_rank, dp, seed):
    gbs = per_rank * dp
    if gbs > n:
        return
    ranks = [ShardedBatchSampler(n, gbs, r, dp, seed=seed) for r in range(dp)]
    steps = ranks[0].steps_per_epoch
    assert steps == n // gbs
    for epoch in range(2):
        seen = []
        for _ in range(steps):
            shares = [next(s) for s in ranks]
            assert all(len(x) == per_rank for x in shares)
            seen += [i for share in shares for i in share]
        assert len(seen) == len(set(seen)) == steps * gbs  # each index at most once, none lost in a batch
        assert set(seen) <= set(range(n))
        assert all(s.epoch == epoch and s.step_in_epoch == steps for s in ranks)


def test_sampler_reshuffles_per_epoch_and_is_deterministic():
    a, b = ShardedBatchSampler(40, 10, seed=3), ShardedBatchSampler(40, 10, seed=3)
    first, second = take(a, 4), take(a, 4)
    assert first == take(b, 4)
    assert sorted(sum(first, [])) == list(range(40)) == sorted(sum(second, []))
    assert first != second  # a new permutation each epoch
    assert take(ShardedBatchSampler(40, 10, seed=4), 4) != first
    assert take(ShardedBatchSampler(40, 10, shuffle=False), 1) == [list(range(10))]


@pytest.mark.parametrize("consumed", [0, 3, 4, 5, 11])  # includes epoch boundaries (4 steps per epoch)
def test_sampler_resume_continues_exactly(consumed):
    straight = ShardedBatchSampler(45, 10, dp_rank=1, dp_size=2, seed=7)
    expected = take(straight, consumed + 9)[consumed:]
    first = ShardedBatchSampler(45, 10, dp_rank=1, dp_size=2, seed=7)
    take(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = ShardedBatchSampler(45, 10, dp_rank=1, dp_size=2, seed=7)
    resumed.load_state_dict(state)
    assert resumed.consumed_steps == consumed
    assert take(resumed, 9) == expected


def test_sampler_resume_at_another_dp_size_keeps_global_batches():
    two = [ShardedBatchSampler(30, 6, r, 2, seed=1) for r in range(2)]
    for s in two:
        take(s, 2)
    one = ShardedBatchSampler(30, 6, 0, 1, seed=1)
    one.load_state_dict(two[0].state_dict())
    assert take(one, 1)[0] == next(two[0]) + next(two[1])


def test_sampler_errors():
    with pytest.raises(D.DataError, match="fewer than one global batch"):
        ShardedBatchSampler(5, 8)
    with pytest.raises(D.DataError, match="not divisible"):
        ShardedBatchSampler(50, 9, 0, 2)
    s = ShardedBatchSampler(50, 10, seed=1)
    with pytest.raises(D.DataError, match="dataset_size=60"):
        s.load_state_dict({**s.state_dict(), "dataset_size": 60})


@pytest.mark.parametrize("n, gbs, dp", [(10, 4, 2), (7, 4, 4), (3, 8, 2), (12, 4, 1)])
def test_eval_batches_cover_every_index_once(n, gbs, dp):
    got = []
    per_rank = [list(eval_batches(n, gbs, r, dp)) for r in range(dp)]
    assert len({len(x) for x in per_rank}) == 1  # same number of batches on every rank
    for r in range(dp):
        for batch in per_rank[r]:
            got += batch
    assert sorted(got) == list(range(n))
