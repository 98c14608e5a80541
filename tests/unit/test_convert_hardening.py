"""Conversion inputs that used to convert silently wrong (issue 12): per-layer Qwen2 windows and a
tied model whose stored lm_head differs from its embedding."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rlhf.checkpoint import hf as conv
from megatron_rlhf.checkpoint import convert_cli
from megatron_rlhf.models import hf_config
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
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "windows 1 of 2 layers" in line
    _no_output(tmp_path, tmp_path / "o")


def test_exported_qwen2_config_windows_every_layer_in_transformers():
    import transformers as tr

    cfg, _ = model_config_from_hf(_qwen2_cfg(max_window_layers=0))
    exported = hf_config.hf_config_from_model_config(cfg)
    assert tr.Qwen2Config(**exported).layer_types == ["sliding_attention"] * 4
    assert model_config_from_hf(dict(exported, architectures=["Qwen2ForCausalLM"]))[0].sliding_window == 8


def test_tied_model_with_a_different_lm_head_is_refused(qwen2, tmp_path, capsys):
    def add_head(sd):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        sd["lm_head.weight"][-1, 0] += 1.0  # differs in the very last row only

    src = _copy_model(qwen2, tmp_path / "m", edit=add_head)
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight" in line
    _no_output(tmp_path, tmp_path / "o")


def test_tied_model_with_an_identical_lm_head_copy_converts(qwen2, tmp_path):
    src = _copy_model(qwen2, tmp_path / "m", edit=lambda sd: sd.update(
        {"lm_head.weight": sd["model.embed_tokens.weight"].clone()}))
    conv.hf_to_megatron(src, tmp_path / "o")
    assert (tmp_path / "o" / conv.META_FILE).is_file()


# ---------------------------------------------------------------------------------------------
# Damaged or malformed input: one `error:` line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(qwen2, tmp_path_factory):
    return conv.hf_to_megatron(qwen2, tmp_path_factory.mktemp("mg") / "mg")


def _variant(src, dst, damage):
    import shutil

    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _size(p):
    return os.path.getsize(p)


@pytest.mark.parametrize("damage, expected", [
    (lambda d: os.truncate(d / "model.safetensors", 1000), "model.safetensors is not a readable safetensors file"),
    (lambda d: os.truncate(d / "model.safetensors", _size(d / "model.safetensors") - 100),
     "model.safetensors is not a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage" * 100), "is not a readable safetensors file"),
    (lambda d: (d / "config.json").write_text("{nope"), "config.json is not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json holds a JSON list, not an object"),
    (lambda d: _bin(d, truncate=True), "pytorch_model.bin is not a readable torch file"),
])
def test_damaged_hf_input_is_one_line(qwen2, tmp_path, capsys, damage, expected):
    src = _variant(qwen2, tmp_path / "m", damage)
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o"), "--quiet"])
    assert line.startswith("error: ") and expected in line, line
    _no_output(tmp_path, tmp_path / "o")


def _bin(d, truncate):
    from safetensors.torch import load_file

    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    if truncate:
        os.truncate(d / "pytorch_model.bin", 300)


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / conv.META_FILE).write_text("{x"), f"{conv.META_FILE} is not valid JSON"),
    (lambda d: (d / conv.META_FILE).write_text("[]"), f"{conv.META_FILE} holds a JSON list"),
    (lambda d: (d / "__0_0.distcp").unlink(), "is damaged: __0_0.distcp is missing (.metadata names it)"),
    (lambda d: os.truncate(d / "__0_0.distcp", 100), "is damaged: __0_0.distcp is truncated (100 of "),
    (lambda d: os.truncate(d / ".metadata", 40), ".metadata is unreadable (UnpicklingError"),
    (lambda d: _scramble(d / "__0_0.distcp"), "is damaged: reading"),
])
def test_damaged_megatron_input_is_one_line(converted, tmp_path, capsys, damage, expected):
    src = _variant(converted, tmp_path / "mg", damage)
    line = _error(capsys, convert_cli.megatron_to_hf_main, ["--megatron-dir", str(src), "--out", str(tmp_path / "o"), "--quiet"])
    assert line.startswith("error: ") and expected in line, line
    _no_output(tmp_path, tmp_path / "o")


def _scramble(path):
    """Same size, garbage bytes: only the read itself can notice."""
    path.write_bytes(b"\x00" * _size(path))


def test_unknown_meta_field_is_ignored_with_a_warning(converted, tmp_path, capsys):
    import json

    def newer(d):
        meta = json.loads((d / conv.META_FILE).read_text())
        (d / conv.META_FILE).write_text(json.dumps(dict(meta, written_by_a_newer_version={"x": 1})))

    src = _variant(converted, tmp_path / "mg", newer)
    assert convert_cli.megatron_to_hf_main(["--megatron-dir", str(src), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {src / conv.META_FILE} has fields this version does not know, ignored: "
                   "written_by_a_newer_version"]
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_missing_hf_dir_says_it_does_not_exist(tmp_path, capsys):
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert line == f"error: --hf-dir {tmp_path / 'nope'} does not exist: pass a Hugging Face model directory"


def test_hf_config_that_is_a_list_is_refused():
    with pytest.raises(UnsupportedModelError, match="must be a JSON object of model settings, not a list"):
        model_config_from_hf([1])
