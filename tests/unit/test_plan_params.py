"""The planner's parameter arithmetic against real one-rank Megatron builds (TP/PP sharding of the
same layouts is checked on 2 ranks in tests/distributed/test_equivalence.py)."""

import pytest

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.plan.params import Layout, embedding_params, layer_params, params_per_gpu, stage_params, total_params

SHAPES = {
    "gqa": dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=64),
    "qkv_bias_tied": dict(num_layers=2, hidden_size=32, ffn_hidden_size=40, num_attention_heads=4, num_query_groups=4,
                          vocab_size=64, add_qkv_bias=True, tie_embeddings=True),
    "head_dim": dict(num_layers=1, hidden_size=24, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=1,
                     kv_channels=8, vocab_size=60, make_vocab_size_divisible_by=8),
}


def _build(shape, head):
    (chunk,) = build_model(ModelConfig(max_position_embeddings=32, **SHAPES[shape]), ParallelConfig(), head=head)
    return chunk


@pytest.mark.parametrize("head", ["lm", "scalar"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_rank_count_equals_the_build(world, shape, head):  # noqa: F811
    model = ModelConfig(max_position_embeddings=32, **SHAPES[shape])
    chunk = _build(shape, head)
    assert stage_params(model, Layout(), 0, head) == sum(p.numel() for p in chunk.parameters())
    # Component by component, so a compensating error cannot hide.
    named = dict(chunk.named_parameters())
    assert named["embedding.word_embeddings.weight"].numel() == embedding_params(model, 1)
    layer0 = sum(p.numel() for n, p in named.items() if n.startswith("decoder.layers.0."))
    assert layer0 == layer_params(model, 1)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("shape", ["gqa", "qkv_bias_tied"])
def test_tp_shards_follow_megatrons_own_partition_marks(world, shape, tp):  # noqa: F811
    """Megatron marks every TP-sharded parameter (`tensor_model_parallel`); a TP=t rank holds 1/t of those
    and all of the rest. The vocabulary (64) needs no extra padding at these TP sizes."""
    model = ModelConfig(max_position_embeddings=32, **SHAPES[shape])
    chunk = _build(shape, "lm")
    expected = sum(p.numel() // tp if getattr(p, "tensor_model_parallel", False) else p.numel() for p in chunk.parameters())
    assert stage_params(model, Layout(tp=tp), 0, "lm") == expected


def test_pipeline_stages_split_layers_and_place_embedding_and_head():
    model = ModelConfig(num_layers=8, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=4,
                        vocab_size=100)
    emb, layer, h = embedding_params(model, 1), layer_params(model, 1), model.hidden_size
    assert stage_params(model, Layout(pp=4), 0) == emb + 2 * layer
    assert stage_params(model, Layout(pp=4), 1) == 2 * layer
    assert stage_params(model, Layout(pp=4), 3) == 2 * layer + h + emb  # final norm + untied LM head
    # VPP=2: rank 0 holds chunks 0 and 4 (1 layer each); the head sits on the last rank's last chunk.
    assert stage_params(model, Layout(pp=4, vpp=2), 0) == emb + 2 * layer
    assert stage_params(model, Layout(pp=4, vpp=2), 3, "scalar") == 2 * layer + h + h
    assert params_per_gpu(model, Layout(pp=4)) == 2 * layer + h + emb
    assert sum(stage_params(model, Layout(pp=4), r) for r in range(4)) == total_params(model)


def test_llama2_7b_by_hand():
    """Llama-2-7B: 32 layers, h=4096, f=11008, 32 heads, vocab 32000, untied: 6,738,415,616 parameters."""
    m = ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                    num_query_groups=32, vocab_size=32000)
    by_hand = 2 * 32000 * 4096 + 32 * (2 * 4096 + 4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096
    assert by_hand == 6_738_415_616
    assert total_params(m) == by_hand
