"""Token-budget micro-batches (data/collate.py `token_groups`): consecutive rows fill the budget (packed: their
tokens; padded: rows x the longest), the default budget is micro_batch_size rows of the step's longest row, every
row lands in exactly one micro-batch in order, and a budget below a row is one line naming both numbers, at the
config check and at the step."""

import pytest

from megatron_rlhf.config import schema as C
from megatron_rlhf.data.collate import TokenBudgetError, collate_sft, microbatches, token_groups
from tests.unit.test_config import base, one_line_error  # noqa: F401  (base: a fixture)


def _ranges(groups):
    return [(g.start, g.stop) for g in groups]


def test_fixed_rows_without_packing_or_budget():
    assert _ranges(token_groups([5, 1, 9, 2, 3], 2, packed=False)) == [(0, 2), (2, 4), (4, 5)]


def test_packed_groups_fill_the_budget_in_order():
    lengths = [8, 1, 1, 30, 2, 2, 2, 40, 5]
    groups = token_groups(lengths, 4, max_tokens=40, packed=True)
    assert _ranges(groups) == [(0, 4), (4, 7), (7, 8), (8, 9)]
    assert all(sum(lengths[g.start:g.stop]) <= 40 for g in groups)
    # The default budget: 4 rows of the longest (40) = 160 tokens, so these 91 tokens are one micro-batch.
    assert _ranges(token_groups(lengths, 4, packed=True)) == [(0, 9)]


def test_padded_groups_count_rows_times_the_longest():
    # 3 rows of up to 10 = 30 <= 30, a 4th would make 40; then 2 x 12 = 24, a 3rd row would make 36.
    assert _ranges(token_groups([10, 2, 2, 2, 12, 1], 1, max_tokens=30, packed=False)) == [(0, 3), (3, 5), (5, 6)]


def test_a_budget_below_a_row_names_both_numbers():
    with pytest.raises(TokenBudgetError, match="a row of 41 tokens is longer than train.max_tokens_per_micro_batch=40"):
        token_groups([3, 41], 2, max_tokens=40, packed=True)


def test_collated_token_budget_microbatches_keep_every_example_once():
    data = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in (6, 2, 2, 9, 1, 4)]
    mbs = microbatches(data, [0, 1, 2, 3, 4, 5], 2, collate_sft, max_tokens=10, packed=True, pad_id=0)
    assert [mb["lengths"].tolist() for mb in mbs] == [[6, 2, 2], [9, 1], [4]]
    padded = microbatches(data, [0, 1, 2, 3, 4, 5], 2, collate_sft, max_tokens=10, pad_id=0)  # rows x the longest
    assert [mb["lengths"].tolist() for mb in padded] == [[6], [2, 2], [9], [1, 4]]


def test_the_config_refuses_a_budget_below_the_longest_row(tmp_path, base):  # noqa: F811
    msg = one_line_error(C.load_config, C.SFTConfig, None,
                         base + ["data.max_seq_len=64", "train.max_tokens_per_micro_batch=32"])
    assert "train.max_tokens_per_micro_batch=32 is below data.max_seq_len=64" in msg


def test_balanced_shares_have_equal_rows_and_balanced_tokens():
    from megatron_rlhf.data.sampler import balanced_share

    lengths = [100, 3, 5, 90, 4, 6, 80, 2]
    shares = [balanced_share(lengths, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8)) and all(len(s) == 4 for s in shares)
    # Longest first to the emptier rank: 100 | 90, 80 | then rank 0 fills with 6, 5, 4 (115), rank 1 takes 3, 2 (175);
    # the contiguous halves would hold 198 against 92.
    assert shares == [[0, 2, 4, 5], [1, 3, 6, 7]]
    with pytest.raises(ValueError, match="7 rows do not split evenly over 2"):
        balanced_share(lengths[:7], 0, 2)


def test_the_sampler_balances_each_global_batch_and_keeps_its_union():
    from megatron_rlhf.data.sampler import ShardedBatchSampler

    lengths = [(i * 37) % 50 + 1 for i in range(64)]
    plain = ShardedBatchSampler(64, 16, 0, 1, seed=3)
    ranks = [ShardedBatchSampler(64, 16, r, 2, seed=3, lengths=lengths) for r in range(2)]
    for _ in range(6):
        shares = [next(s) for s in ranks]
        assert sorted(shares[0] + shares[1]) == sorted(next(plain)) and len(shares[0]) == len(shares[1]) == 8
        t = [sum(lengths[i] for i in s) for s in shares]
        assert abs(t[0] - t[1]) <= max(lengths)
