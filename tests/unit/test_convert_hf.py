"""HF <-> Megatron checkpoint conversion in one process: round trips, file formats, bad input.

Logits parity at TP=1/TP=2/PP=2 needs process groups and lives in tests/distributed/test_convert.py.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rlhf.checkpoint import hf as conv
from megatron_rlhf.checkpoint import convert_cli
from megatron_rlhf.checkpoint.hf_io import HFCheckpoint
from tests.unit import hf_tiny_models as tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny.save_all(tmp_path_factory.mktemp("hf"))


def _tensors(d) -> dict:
    c = HFCheckpoint(d)
    return {n: c.get(n) for n in c.names()}


def _error(capsys, fn, argv) -> str:
    """Run a CLI main; it must fail with exit code 2 and exactly one line on stderr."""
    assert fn(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("name", tiny.ALL)
def test_roundtrip_is_bit_identical_and_transformers_loads_it(models, tmp_path, name):
    import transformers as tr

    src = models[name]
    mg, back = tmp_path / "mg", tmp_path / "back"
    assert convert_cli.hf_to_megatron_main(["--hf-dir", str(src), "--out", str(mg), "--quiet"]) == 0
    assert convert_cli.megatron_to_hf_main(["--megatron-dir", str(mg), "--out", str(back), "--quiet"]) == 0
    a, b = _tensors(src), _tensors(back)
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((mg / conv.META_FILE).read_text())
    assert meta["head"] == ("scalar" if name.endswith("_rm") else "lm") and meta["dtype"] == "float32"
    assert meta["model_config"]["vocab_size"] == tiny.VOCAB and meta["source"] == str(src)
    # Tokenizer files travel: into the checkpoint's tokenizer/ and back next to the weights.
    assert json.loads((back / "tokenizer_config.json").read_text())["marker"] == name
    assert (mg / "tokenizer" / "tokenizer_config.json").is_file()
    # transformers accepts the written config and weights; same outputs as the source model.
    cls = tr.AutoModelForSequenceClassification if name.endswith("_rm") else tr.AutoModelForCausalLM
    reloaded = cls.from_pretrained(back).eval()
    ref = torch.load(src.parent / f"{name}.ref.pt")
    with torch.no_grad():
        out = reloaded(input_ids=ref["tokens"]).logits
    assert torch.equal(out, ref["scores"] if name.endswith("_rm") else ref["logits"])


def test_megatron_checkpoint_layout(models, tmp_path):
    """Stacked TE-style keys, fc1 in two chunks, unpadded vocab, extra-state objects, Megatron's config."""
    from torch.distributed.checkpoint import FileSystemReader

    mg = conv.hf_to_megatron(models["qwen2"], tmp_path / "mg")
    md = FileSystemReader(str(mg)).read_metadata().state_dict_metadata
    assert tuple(md["decoder.layers.self_attention.linear_qkv.weight"].size) == (2, (4 + 4 + 4) * 16, 64)
    assert tuple(md["decoder.layers.self_attention.linear_qkv.bias"].size) == (2, 192)
    assert tuple(md["embedding.word_embeddings.weight"].size) == (tiny.VOCAB, 64)
    assert "output_layer.weight" not in md  # tied
    fc1 = md["decoder.layers.mlp.linear_fc1.weight"]
    assert tuple(fc1.size) == (2, 192, 64) and len(fc1.chunks) == 4
    assert "decoder.layers.self_attention.linear_proj._extra_state/shard_1_2" in md
    assert json.loads((mg / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (mg / "common.pt").is_file()


def test_bfloat16_and_sharded_output(models, tmp_path):
    mg, back = tmp_path / "mg", tmp_path / "back"
    conv.hf_to_megatron(models["mistral"], mg, dtype="bfloat16")
    conv.megatron_to_hf(mg, back, max_shard_bytes=60_000)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((back / f).is_file() for f in files)
    a, b = _tensors(models["mistral"]), _tensors(back)
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"


def test_causal_lm_seeds_a_reward_model_and_exports_a_sequence_classifier(models, tmp_path):
    import transformers as tr

    mg, back = tmp_path / "mg", tmp_path / "back"
    conv.hf_to_megatron(models["llama"], mg, head="scalar")
    conv.megatron_to_hf(mg, back)
    out = _tensors(back)
    assert torch.equal(out["score.weight"], torch.zeros(1, 64)) and "lm_head.weight" not in out
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    model = tr.AutoModelForSequenceClassification.from_pretrained(back)
    assert model.config.num_labels == 1


def test_config_written_without_the_original(models, tmp_path):
    """A checkpoint whose metadata lacks the HF config (e.g. made in training) still exports loadably."""
    import transformers as tr

    mg, back = tmp_path / "mg", tmp_path / "back"
    conv.hf_to_megatron(models["llama"], mg)
    meta = conv.ConvertMeta.read(mg)
    meta.hf_config = None
    meta.write(mg)
    conv.megatron_to_hf(mg, back)
    model = tr.AutoModelForCausalLM.from_pretrained(back).eval()
    ref = torch.load(models["llama"].parent / "llama.ref.pt")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ref["tokens"]).logits, ref["logits"])  # rope llama3 kept


def test_training_checkpoint_with_key_prefix_and_hf_config(models, tmp_path):
    """--key-prefix + --hf-config: a checkpoint without our metadata (as training writes them)."""
    mg, back = tmp_path / "mg", tmp_path / "back"
    conv.hf_to_megatron(models["qwen2"], mg, key_prefix="policy.")
    (mg / conv.META_FILE).unlink()
    argv = ["--megatron-dir", str(mg), "--out", str(back), "--hf-config", str(models["qwen2"]), "--key-prefix", "policy."]
    assert convert_cli.megatron_to_hf_main(argv + ["--quiet"]) == 0
    a, b = _tensors(models["qwen2"]), _tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_legacy_bin_checkpoint_loads_with_weights_only(models, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text((models["mistral"] / "config.json").read_text())
    torch.save(_tensors(models["mistral"]), src / "pytorch_model.bin")
    conv.hf_to_megatron(src, tmp_path / "mg")
    conv.megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    a, b = _tensors(models["mistral"]), _tensors(tmp_path / "back")
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_bin_with_code_is_refused(models, tmp_path, capsys):
    src = tmp_path / "evil"
    src.mkdir()
    (src / "config.json").write_text((models["mistral"] / "config.json").read_text())
    with open(src / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "does not load with torch.load(weights_only=True)" in line and "refused" in line
    assert "pwned" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Bad input: one clear line, nothing written
# ---------------------------------------------------------------------------------------------


def _copy_model(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = _tensors(src)
    if edit:
        edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _no_output(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]


def test_unsupported_architecture_lists_supported(models, tmp_path, capsys):
    src = _copy_model(models["mistral"], tmp_path / "gpt", config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"], auto_map={"AutoModel": "x.Y"}))
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "unsupported architecture 'GPT2LMHeadModel'" in line and "LlamaForCausalLM" in line and "Qwen2ForCausalLM" in line
    _no_output(tmp_path, tmp_path / "o")


def test_missing_tensor_is_named(models, tmp_path, capsys):
    src = _copy_model(models["mistral"], tmp_path / "m", edit=lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in line
    _no_output(tmp_path, tmp_path / "o")


def test_unexpected_tensor_is_named(models, tmp_path, capsys):
    src = _copy_model(models["mistral"], tmp_path / "m", edit=lambda sd: sd.update({"model.layers.0.extra.weight": torch.ones(2)}))
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "unexpected tensor model.layers.0.extra.weight" in line


def test_shape_mismatch_names_expected_and_found(models, tmp_path, capsys):
    def shrink(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:32].clone()

    src = _copy_model(models["mistral"], tmp_path / "m", edit=shrink)
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(src), "--out", str(tmp_path / "o")])
    assert "shape mismatch for model.layers.0.self_attn.k_proj.weight: expected (64, 64), found (32, 64)" in line


def test_tp_that_does_not_divide(models, tmp_path, capsys):
    argv = ["--hf-dir", str(models["llama"]), "--out", str(tmp_path / "o"), "--target-tp", "4"]
    line = _error(capsys, convert_cli.hf_to_megatron_main, argv)
    assert line == "error: tensor parallel size 4 does not divide num_query_groups (num_key_value_heads)=2: pick a TP that divides 2"
    _no_output(tmp_path, tmp_path / "o")


def test_existing_output_needs_overwrite(models, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    line = _error(capsys, convert_cli.hf_to_megatron_main, ["--hf-dir", str(models["qwen2"]), "--out", str(out)])
    assert line == f"error: output directory {out} already exists: pass --overwrite or choose another --out"
    assert (out / "keep").is_file()
    line = _error(capsys, convert_cli.megatron_to_hf_main, ["--megatron-dir", str(models["qwen2"]), "--out", str(out)])
    assert "already exists" in line
    # --overwrite replaces only a converter's output (tests/unit/test_convert_outputs.py has the rest).
    argv = ["--hf-dir", str(models["qwen2"]), "--out", str(out), "--overwrite", "--quiet"]
    assert "does not look like a converter output" in _error(capsys, convert_cli.hf_to_megatron_main, argv)
    (out / "keep").unlink()
    (out / conv.META_FILE).write_text("{}")
    assert convert_cli.hf_to_megatron_main(argv) == 0
    assert (out / conv.META_FILE).read_text() != "{}"


def test_sequence_classifier_has_no_lm_head(models, tmp_path, capsys):
    argv = ["--hf-dir", str(models["llama_rm"]), "--out", str(tmp_path / "o"), "--head", "lm"]
    assert "is a sequence classifier: it has no LM head to convert; use --head scalar" in _error(capsys, convert_cli.hf_to_megatron_main, argv)


def test_not_a_converted_checkpoint(tmp_path, capsys):
    (tmp_path / "mg").mkdir()
    line = _error(capsys, convert_cli.megatron_to_hf_main, ["--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "o")])
    assert f"no {conv.META_FILE} in {tmp_path / 'mg'}" in line


def test_failure_midway_leaves_nothing(models, tmp_path, monkeypatch):
    """An error while tensors are being written: no output dir and no temp dir left behind."""
    calls = {"n": 0}
    real_get = HFCheckpoint.get

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError("disk on fire")
        return real_get(self, name)

    monkeypatch.setattr(HFCheckpoint, "get", flaky)
    with pytest.raises(Exception, match="disk on fire"):
        conv.hf_to_megatron(models["llama"], tmp_path / "o")
    _no_output(tmp_path, tmp_path / "o")


def test_tools_scripts_run(models, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for script, args in (
        ("convert_hf_to_megatron.py", ["--hf-dir", str(models["qwen2"]), "--out", str(tmp_path / "mg")]),
        ("convert_megatron_to_hf.py", ["--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "hf")]),
    ):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / script), *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == set(_tensors(models["qwen2"]))
