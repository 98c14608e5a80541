"""Pure parts of the hybrid engine: the row split and gathers of rollout/redistribute.py, the layout
checks of config/rollout.py, and the vLLM entry check (no process groups, milliseconds)."""

import pytest
import torch

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.rollout import redistribute as R
from megatron_rlhf.rollout.layout import same_layout
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.config.rollout import check_layout_tp

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  vocab_size=17, max_position_embeddings=32)


@pytest.mark.parametrize("total,parts", [(5, 2), (8, 4), (3, 4), (1, 1), (7, 3)])
def test_part_rows_cover_every_row_once(total, parts):
    pieces = [R.part_rows(total, parts, p) for p in range(parts)]
    assert len({len(index) for index, _ in pieces}) == 1  # equal sizes: gathers need no ragged shapes
    real = torch.cat([index[:n] for index, n in pieces])
    assert real.tolist() == list(range(total))  # no duplicate, no loss, in order


def test_concat_prompts_left_pads_to_the_widest_share_and_keeps_draws_with_rows():
    a = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[False, True, True]]),
         "uniforms": torch.tensor([[0.1]])}
    b = {"input_ids": torch.tensor([[7], [8]]), "attention_mask": torch.tensor([[True], [True]]),
         "uniforms": torch.tensor([[0.2], [0.3]])}
    out = R.concat_prompts([a, b], pad_id=0)
    assert out["input_ids"].tolist() == [[0, 5, 6], [0, 0, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[False, True, True], [False, False, True], [False, False, True]]
    assert out["uniforms"].squeeze(1).tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_concat_parts_drops_padding_rows_and_share_bounds_return_each_share():
    total, parts = 5, 2
    decoded = [{"x": torch.as_tensor(R.part_rows(total, parts, p)[0])} for p in range(parts)]
    reals = [R.part_rows(total, parts, p)[1] for p in range(parts)]
    everything = R.concat_parts(decoded, reals)["x"]
    assert everything.tolist() == [0, 1, 2, 3, 4]
    assert [everything[R.share_bounds([3, 2], i)].tolist() for i in (0, 1)] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("tp,world,fragment", [
    (3, 4, "rollout.tp=3 does not divide the world size 4"),
    (4, 4, "does not divide model.num_attention_heads=4 and model.num_query_groups=2"),
])
def test_bad_generation_tp_is_one_line_error(tp, world, fragment):
    with pytest.raises(ConfigError) as e:
        check_layout_tp("rollout.tp", tp, world, CFG, train_tp=1)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_generation_tp_must_split_the_training_vocab_padding():
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                      vocab_size=17, max_position_embeddings=32, make_vocab_size_divisible_by=2)
    check_layout_tp("rollout.tp", 2, 4, cfg, train_tp=2)  # 20 rows split in 2: fine
    with pytest.raises(ConfigError, match="does not divide the padded vocabulary 18"):
        check_layout_tp("rollout.tp", 4, 4, cfg, train_tp=1)


def test_equal_layouts_need_no_copy():
    assert same_layout(ParallelConfig(tp=2), 2)
    assert not same_layout(ParallelConfig(tp=2), 1)
    assert not same_layout(ParallelConfig(tp=1, pp=2), 1)


def test_vllm_on_cpu_is_a_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the CPU refusal does not apply")
    from megatron_rlhf.config.rollout import require_vllm

    with pytest.raises(ConfigError) as e:
        require_vllm()
    assert "rollout.engine=vllm needs CUDA" in str(e.value) and "\n" not in str(e.value)


def test_vllm_weight_buckets_and_response_packing():
    from megatron_rlhf.rollout.vllm_engine import buckets, responses

    tensors = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each (fp32)
    sizes = [[n for n, _ in b] for b in buckets(tensors, 2048)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    out = responses([[5, 9], [4, 4, 4]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], [True, False], T=3, pad_id=0)
    assert out["response_ids"].tolist() == [[5, 9, 0], [4, 4, 4]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["lengths"].tolist() == [2, 3] and out["ended"].tolist() == [True, False]
    assert out["logprobs"][0].tolist() == pytest.approx([-0.5, -1.0, 0.0])
