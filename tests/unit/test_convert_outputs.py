"""Conversion edge cases (issue 12): where --out may go, what --overwrite may replace, temp dirs a
killed conversion left, shard size, source dtypes, remote code, pickle refusals, program names."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from megatron_rlhf import cli
from megatron_rlhf.checkpoint import hf as conv
from megatron_rlhf.checkpoint import convert_cli
from tests.unit import hf_tiny_models as tiny
from tests.unit.test_convert_hf import _copy_model, _error, _tensors


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny.save("mistral", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def mg(src, tmp_path_factory):
    return conv.hf_to_megatron(src, tmp_path_factory.mktemp("mg") / "mg")


def _h2m(src, out, *extra):
    return ["--hf-dir", str(src), "--out", str(out), "--quiet", *extra]


def _m2h(mg, out, *extra):
    return ["--megatron-dir", str(mg), "--out", str(out), "--quiet", *extra]


@pytest.mark.parametrize("where, words", [(lambda d: d, "is the same directory as"),
                                          (lambda d: d / "sub", "is inside"),
                                          (lambda d: d.parent, "contains")])
def test_out_on_the_input_is_refused_even_with_overwrite(src, mg, tmp_path, capsys, where, words):
    for fn, argv, inp, flag in ((convert_cli.hf_to_megatron_main, _h2m, src, "--hf-dir"),
                                (convert_cli.megatron_to_hf_main, _m2h, mg, "--megatron-dir")):
        copy = shutil.copytree(inp, tmp_path / f"in_{flag}" / "model")
        before = sorted(os.listdir(copy))
        line = _error(capsys, fn, argv(copy, where(copy), "--overwrite"))
        assert f" {words} {flag}" in line and "would destroy the input" in line, line
        assert sorted(os.listdir(copy)) == before


def test_out_on_the_hf_config_source_is_refused(src, mg, tmp_path, capsys):
    hf = shutil.copytree(src, tmp_path / "hf")
    line = _error(capsys, convert_cli.megatron_to_hf_main, _m2h(mg, hf, "--overwrite", "--hf-config", str(hf)))
    assert "is the same directory as --hf-config" in line


@pytest.mark.parametrize("kind", ["h2m", "m2h"])
def test_overwrite_replaces_only_our_own_output(src, mg, tmp_path, capsys, kind):
    fn, argv, inp = (convert_cli.hf_to_megatron_main, _h2m, src) if kind == "h2m" else (convert_cli.megatron_to_hf_main, _m2h, mg)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    line = _error(capsys, fn, argv(inp, foreign, "--overwrite"))
    assert "does not look like a converter output" in line and "will not replace it" in line
    assert (foreign / "thesis.tex").read_text() == "years of work"
    ours = tmp_path / "ours"
    assert fn(argv(inp, ours)) == 0
    assert fn(argv(inp, ours, "--overwrite")) == 0  # our own output: replaced
    (tmp_path / "empty").mkdir()
    assert fn(argv(inp, tmp_path / "empty", "--overwrite")) == 0  # an empty directory is fine too


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_dirs_are_removed_or_named(src, tmp_path, capsys):
    out = tmp_path / "o"
    host = socket.gethostname()
    stale = tmp_path / f".o.tmp-{_dead_pid()}@{host}-abc123"
    running = tmp_path / f".o.tmp-{os.getppid()}@{host}-def456"  # a live process: not ours to remove
    legacy = tmp_path / ".o.tmp-x1y2z3"  # written before temp dirs carried their owner
    for d in (stale, running, legacy):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"\0" * 1000)
    assert convert_cli.hf_to_megatron_main(_h2m(src, out)) == 0
    err = capsys.readouterr().err
    assert not stale.exists() and f"removed {stale}: left by a conversion" in err
    assert running.exists() and f"warning: {running} belongs to a conversion still running" in err
    assert legacy.exists() and f"warning: {legacy} was left by an interrupted conversion" in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.tmp-") and p not in (running, legacy)]


def test_killed_conversion_leaves_a_temp_dir_the_next_one_removes(src, tmp_path):
    """A real kill -9 in the middle of writing, then a rerun."""
    out = tmp_path / "o"
    code = ("import sys, time; from megatron_rlhf.checkpoint import hf_io, hf as c\n"
            "real = hf_io.HFCheckpoint.get\n"
            "def slow(self, name):\n    time.sleep(0.05); print('writing', flush=True); time.sleep(600)\n"
            "hf_io.HFCheckpoint.get = slow\n"
            f"c.hf_to_megatron({str(src)!r}, {str(out)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".o.tmp-")]
    assert len(left) == 1 and not out.exists()
    conv.hf_to_megatron(src, out)
    assert not left[0].exists() and out.is_dir()


@pytest.mark.parametrize("gb", ["0", "-1"])
def test_max_shard_gb_must_be_positive(mg, tmp_path, capsys, gb):
    line = _error(capsys, convert_cli.megatron_to_hf_main, _m2h(mg, tmp_path / "o", "--max-shard-gb", gb))
    assert line == f"error: --max-shard-gb must be > 0 (got {float(gb):g})"


def test_float64_source_is_reported_and_converts_only_with_dtype(src, tmp_path, capsys):
    f64 = _copy_model(src, tmp_path / "f64", edit=lambda sd: sd.update({k: v.double() for k, v in sd.items()}),
                      config_edit=lambda c: c.update(torch_dtype="float64", dtype="float64"))
    line = _error(capsys, convert_cli.hf_to_megatron_main, _h2m(f64, tmp_path / "o"))
    assert "holds float64 weights" in line and "pass --dtype float32" in line
    assert convert_cli.hf_to_megatron_main(_h2m(f64, tmp_path / "o", "--dtype", "float32")) == 0
    assert convert_cli.megatron_to_hf_main(_m2h(tmp_path / "o", tmp_path / "back")) == 0
    a, b = _tensors(src), _tensors(tmp_path / "back")
    assert all(b[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)


def test_float8_source_is_refused(src, tmp_path, capsys):
    f8 = _copy_model(src, tmp_path / "f8", edit=lambda sd: sd.update(
        {"model.layers.0.mlp.up_proj.weight": sd["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)}))
    line = _error(capsys, convert_cli.hf_to_megatron_main, _h2m(f8, tmp_path / "o", "--dtype", "bfloat16"))
    assert "model.layers.0.mlp.up_proj.weight" in line and "F8_E4M3 (float8: a quantized checkpoint)" in line
    quant = _copy_model(src, tmp_path / "q", config_edit=lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    line = _error(capsys, convert_cli.hf_to_megatron_main, _h2m(quant, tmp_path / "o"))
    assert "quantized checkpoint (quant_method=fp8)" in line


def test_auto_map_on_a_supported_architecture_warns_that_remote_code_is_ignored(src, tmp_path, capsys):
    remote = _copy_model(src, tmp_path / "r", config_edit=lambda c: c.update(
        auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}))
    assert convert_cli.hf_to_megatron_main(_h2m(remote, tmp_path / "o")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: config.json in {remote} has auto_map (AutoModelForCausalLM): that remote code is "
                   "ignored; the weights are converted as the built-in MistralForCausalLM"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_pickle_refusal_names_the_global_in_full(src, tmp_path, capsys, writer):
    d = tmp_path / "evil"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    state = {"x": _Evil(), "t": torch.ones(2)}
    if writer == "pickle":
        with open(d / "pytorch_model.bin", "wb") as f:
            pickle.dump(state, f)
    else:
        torch.save(state, d / "pytorch_model.bin")
    line = _error(capsys, convert_cli.hf_to_megatron_main, _h2m(d, tmp_path / "o"))
    # A plain pickle of a tensor names torch.storage._load_from_bytes, which megatron-core 0.19's import replaces
    # with its own function (refused by weights_only too, so named as well).
    storage = re.escape(f", {torch.storage._load_from_bytes.__module__}.{torch.storage._load_from_bytes.__name__}")
    assert re.search(rf"it needs {os.system.__module__}\.system({storage})?, which is not a tensor type", line), line
    assert "refused" in line, line
    assert "pwned" not in capsys.readouterr().out


def test_convert_usage_shows_its_own_program_name(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "hf-to-megatron", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: megatron-rlhf convert hf-to-megatron ")
    assert cli.main(["convert"]) == 2
    assert capsys.readouterr().err.startswith("usage: megatron-rlhf convert {hf-to-megatron|megatron-to-hf}")
    with pytest.raises(SystemExit):
        cli.main(["convert", "megatron-to-hf", "--bogus"])
    assert "usage: megatron-rlhf convert megatron-to-hf " in capsys.readouterr().err
