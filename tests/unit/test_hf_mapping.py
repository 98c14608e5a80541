"""The HF <-> Megatron name map and its transforms (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.models import hf_mapping as hm
from megatron_rlhf.models.spec import ModelConfig, model_config_from_hf
from tests.unit import hf_tiny_models as tiny


def _cfg(**kw) -> ModelConfig:
    base = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=2,
        vocab_size=101, add_qkv_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("name", tiny.ALL)
def test_expected_names_and_shapes_are_the_hf_state_dict(name):
    model = tiny.build(name)
    cfg, head = model_config_from_hf(dict(model.config.to_dict(), architectures=[type(model).__name__]))
    sd = model.state_dict()
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")  # tied: save_pretrained writes only the embedding
    expected = hm.expected_hf_shapes(cfg, head)
    assert set(expected) == set(sd)
    assert all(tuple(sd[k].shape) == s for k, s in expected.items())


def test_local_and_te_names_map_to_the_same_hf_tensors():
    cfg = _cfg()
    pairs = {
        "decoder.layers.3.input_layernorm.weight": "model.layers.3.input_layernorm.weight",
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "model.layers.3.input_layernorm.weight",
        "decoder.layers.3.pre_mlp_layernorm.weight": "model.layers.3.post_attention_layernorm.weight",
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": "model.layers.3.post_attention_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "decoder.layers.1.mlp.linear_fc2.weight": "model.layers.1.mlp.down_proj.weight",
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    for meg, hf in pairs.items():
        rule, layer = hm.match_megatron(meg, cfg)
        assert rule.hf_names(layer) == (hf,)
        r2, l2, i = hm.match_hf(hf, cfg)
        assert (r2, l2, i) == (rule, layer, 0)
    rule, layer = hm.match_megatron("decoder.layers.5.self_attention.linear_qkv.weight", cfg)
    assert rule.hf_names(layer) == tuple(f"model.layers.5.self_attn.{x}_proj.weight" for x in "qkv")
    rule, layer = hm.match_megatron("decoder.layers.5.mlp.linear_fc1.weight", cfg)
    assert rule.hf_names(layer) == ("model.layers.5.mlp.gate_proj.weight", "model.layers.5.mlp.up_proj.weight")
    # Checkpoint keys are Megatron's: TE-style names, layers stacked under one key.
    keys = {r.ckpt_key for r in hm.rules_for(cfg)}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.layers.self_attention.linear_qkv.bias" in keys


def test_heads_and_tied_embeddings_select_rules():
    tied = _cfg(tie_embeddings=True)
    assert "lm_head.weight" not in hm.expected_hf_shapes(tied, "lm")
    assert hm.expected_hf_shapes(tied, "scalar")["score.weight"] == (1, 64)
    assert "lm_head.weight" in hm.expected_hf_shapes(_cfg(), "lm")
    assert "score.weight" not in hm.expected_hf_shapes(_cfg(), "lm")
    no_bias = _cfg(add_qkv_bias=False)
    assert not any(n.endswith("_proj.bias") for n in hm.expected_hf_shapes(no_bias))
    rule, _ = hm.match_megatron("output_layer.weight", _cfg(), "scalar")
    assert rule.hf == ("score.weight",) and rule.kind == "replicated"
    with pytest.raises(hm.ConversionError, match="no HF mapping for Megatron parameter 'output_layer.weight'"):
        hm.match_megatron("output_layer.weight", tied, "lm")
    with pytest.raises(hm.ConversionError, match="unexpected tensor 'model.layers.0.mlp.fancy.weight'"):
        hm.match_hf("model.layers.0.mlp.fancy.weight", _cfg())


def test_qkv_interleave_is_per_group():
    cfg = _cfg(num_attention_heads=6, num_query_groups=2, kv_channels=4, hidden_size=8)
    hd, per = 4, 3
    # Row r of q belongs to head r // hd; label each row with (kind, head) so the layout is readable.
    q = torch.arange(6 * hd).float().unsqueeze(1).expand(-1, 8) + 1000
    k = torch.arange(2 * hd).float().unsqueeze(1).expand(-1, 8) + 2000
    v = torch.arange(2 * hd).float().unsqueeze(1).expand(-1, 8) + 3000
    qkv = hm.qkv_merge(q, k, v, cfg)
    assert qkv.shape == (2 * (per + 2) * hd, 8)
    for g in range(2):
        block = qkv[g * (per + 2) * hd : (g + 1) * (per + 2) * hd, 0]
        assert torch.equal(block[: per * hd], q[g * per * hd : (g + 1) * per * hd, 0])
        assert torch.equal(block[per * hd : (per + 1) * hd], k[g * hd : (g + 1) * hd, 0])
        assert torch.equal(block[(per + 1) * hd :], v[g * hd : (g + 1) * hd, 0])
    for a, b in zip(hm.qkv_split(qkv, cfg), (q, k, v)):
        assert torch.equal(a, b)
    # Biases ([n]) use the same layout.
    qb, kb, vb = q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()
    assert torch.equal(hm.qkv_merge(qb, kb, vb, cfg), qkv[:, 0])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_every_kind(tp):
    cfg = _cfg(vocab_size=101, num_query_groups=4)
    hm.check_tp(cfg, tp)
    g = torch.Generator().manual_seed(0)
    for rule in hm.rules_for(cfg, "lm") + hm.rules_for(cfg, "scalar"):
        hf = [torch.randn(s, generator=g) for s in hm.hf_shapes(rule, cfg)]
        full = hm.to_canonical(rule, hf, cfg)
        assert tuple(full.shape) == hm.canonical_shape(rule, cfg)
        shards = [hm.shard(rule, full, cfg, tp, r) for r in range(tp)]
        assert len({tuple(s.shape) for s in shards}) == 1, rule.local
        back = hm.unshard(rule, shards, cfg)
        assert torch.equal(back, full), (rule.local, tp)
        assert all(torch.equal(a, b) for a, b in zip(hm.from_canonical(rule, back, cfg), hf))


def test_gate_up_shard_is_gate_i_then_up_i_and_vocab_is_padded_with_zeros():
    cfg = _cfg(ffn_hidden_size=8, vocab_size=5)
    fc1 = next(r for r in hm.RULES if r.kind == "gate_up")
    gate = torch.arange(8 * 64).reshape(8, 64).float()
    up = -gate
    full = hm.to_canonical(fc1, [gate, up], cfg)
    s1 = hm.shard(fc1, full, cfg, 2, 1)
    assert torch.equal(s1, torch.cat([gate[4:], up[4:]]))  # not a slice of [gate; up]
    emb = next(r for r in hm.RULES if r.kind == "vocab")
    table = torch.randn(5, 64)
    s = [hm.shard(emb, table, cfg, 2, r) for r in range(2)]
    assert s[0].shape == (3, 64) and torch.equal(s[1][2], torch.zeros(64))  # 5 -> 6 rows
    assert torch.equal(hm.unshard(emb, s, cfg), table)


def test_check_tp_names_the_number_that_does_not_divide():
    hm.check_tp(_cfg(), 2)
    with pytest.raises(hm.ConversionError, match=r"tensor parallel size 3 does not divide num_attention_heads=8"):
        hm.check_tp(_cfg(), 3)
    with pytest.raises(hm.ConversionError, match=r"does not divide num_query_groups \(num_key_value_heads\)=2"):
        hm.check_tp(_cfg(), 4)
    with pytest.raises(hm.ConversionError, match=r"does not divide ffn_hidden_size \(intermediate_size\)=100"):
        hm.check_tp(_cfg(num_query_groups=8, ffn_hidden_size=100), 8)
