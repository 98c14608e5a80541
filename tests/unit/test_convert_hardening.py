"""Conversion inputs that used to convert silently wrong (issue 12): per-layer Qwen2 windows and a
tied model whose stored lm_head differs from its embedding."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.checkpoint import hf as conv
from megatron_rlhf.models.spec import UnsupportedModelError, model_config_from_hf
from tests.unit import hf_tiny_models as tiny
from tests.unit.test_convert_hf import _copy_model, _error, _no_output


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny.save("qwen2", tmp_path_factory.mktemp("hf"))


def _qwen2_cfg(**kw) -> dict:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 101, "sliding_window": 8,
           "use_sliding_window": True}
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("extra, window", [
    ({"max_window_layers": 0}, 8),  # every layer windowed: what Megatron does
    ({"max_window_layers": 4}, None),  # no layer windowed (i >= max_window_layers slides)
    ({}, None),  # transformers' default max_window_layers=28 >= 4 layers
    ({"layer_types": ["sliding_attention"] * 4, "max_window_layers": 2}, 8),  # layer_types wins
    ({"use_sliding_window": False, "max_window_layers": 0}, None),
])
def test_qwen2_window_follows_the_layers_hf_windows(extra, window):
    assert model_config_from_hf(_qwen2_cfg(**extra))[0].sliding_window == window


@pytest.mark.parametrize("extra, what", [
    ({"max_window_layers": 1}, "windows 3 of 4 layers (max_window_layers=1)"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "windows 2 of 4 layers (layer_types)"),
])
def test_qwen2_per_layer_windows_are_refused(extra, what):
    with pytest.raises(UnsupportedModelError, match="per-layer windows are not supported") as e:
        model_config_from_hf(_qwen2_cfg(**extra))
    assert what in str(e.value) and "\n" not in str(e.value)


def test_qwen2_per_layer_windows_refused_by_the_converter(qwen2, tmp_path, capsys):
    def window_layer_1(c):
        c.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
        c.pop("layer_types", None)  # transformers >= 4.53 writes it; it would win over max_window_layers

    src = _copy_model(qwen2, tmp_path / "m", config_edit=window_layer_1)
    line = _error(capsys, conv.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "windows 1 of 2 layers" in line
    _no_output(tmp_path, tmp_path / "o")


def test_exported_qwen2_config_windows_every_layer_in_transformers():
    import transformers as tr

    cfg, _ = model_config_from_hf(_qwen2_cfg(max_window_layers=0))
    exported = conv.hf_config_from_model_config(cfg)
    assert tr.Qwen2Config(**exported).layer_types == ["sliding_attention"] * 4
    assert model_config_from_hf(dict(exported, architectures=["Qwen2ForCausalLM"]))[0].sliding_window == 8


def test_tied_model_with_a_different_lm_head_is_refused(qwen2, tmp_path, capsys):
    def add_head(sd):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        sd["lm_head.weight"][-1, 0] += 1.0  # differs in the very last row only

    src = _copy_model(qwen2, tmp_path / "m", edit=add_head)
    line = _error(capsys, conv.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight" in line
    _no_output(tmp_path, tmp_path / "o")


def test_tied_model_with_an_identical_lm_head_copy_converts(qwen2, tmp_path):
    src = _copy_model(qwen2, tmp_path / "m", edit=lambda sd: sd.update(
        {"lm_head.weight": sd["model.embed_tokens.weight"].clone()}))
    conv.hf_to_megatron(src, tmp_path / "o")
    assert (tmp_path / "o" / conv.META_FILE).is_file()
