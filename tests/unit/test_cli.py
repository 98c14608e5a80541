"""The megatron-rlhf command: help texts, dispatch, one-line errors with exit code 2."""

import os
import subprocess
import sys

import pytest

from megatron_rlhf import cli
from megatron_rlhf.config import schema as C
from megatron_rlhf.data.dataset import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALLS = []


def fake_run(cfg):
    """Stands in for a trainer's run(cfg)."""
    CALLS.append(cfg)
    if cfg.train.seed == 666:
        raise DataError("data x.jsonl: 3 of 4 rows are malformed")


@pytest.fixture
def paths(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    return [f"data.train_path={data}", f"tokenizer.path={tok}"]


@pytest.fixture
def fake_sft(monkeypatch):
    CALLS.clear()
    monkeypatch.setitem(cli.COMMANDS, "sft", cli.Command("test", "tests.unit.test_cli:fake_run", C.SFTConfig))


@pytest.mark.parametrize("command, groups", [
    ("sft", ["model", "parallel", "fp8", "tokenizer", "data", "train", "checkpoint", "logging"]),
    ("rm", ["model", "data", "train", "checkpoint", "logging", "calibration"]),
])
def test_help_lists_config_groups_and_fields(capsys, command, groups):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for group in groups:
        assert f"\n{group}:" in out
    assert "train.lr (float)" in out and "data.overlong (str) = 'truncate'" in out and "[truncate|drop]" in out
    assert ("calibration.num_prompts" in out) == (command == "rm")


def test_top_level_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("sft", "rm", "prepare-tiny"))
    assert cli.main([]) == 2


def test_config_command_gets_the_merged_config(tmp_path, paths, fake_sft):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("train:\n  lr: 0.01\n")
    assert cli.main(["sft", str(yaml), *paths, "train.lr=0.002", "parallel.tp=2"]) == 0
    (cfg,) = CALLS
    assert isinstance(cfg, C.SFTConfig) and cfg.train.lr == 0.002 and cfg.parallel.tp == 2
    # without a YAML file, the first argument is an override
    assert cli.main(["sft", *paths, "train.lr=0.003"]) == 0
    assert CALLS[-1].train.lr == 0.003


def test_config_error_is_one_line_and_exit_2(capsys, paths, fake_sft):
    assert cli.main(["sft", *paths, "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "did you mean 'train.lr'" in err
    assert not CALLS


def test_data_error_during_run_exits_2(capsys, paths, fake_sft):
    assert cli.main(["sft", *paths, "train.seed=666"]) == 2
    err = capsys.readouterr().err
    assert err == "error: data x.jsonl: 3 of 4 rows are malformed\n"


def test_print_config_round_trips(tmp_path, capsys, paths, fake_sft):
    assert cli.main(["sft", *paths, "train.lr=0.004", "--print-config"]) == 0
    assert not CALLS
    out = tmp_path / "printed.yaml"
    out.write_text(capsys.readouterr().out)
    assert C.load_config(C.SFTConfig, str(out), []).train.lr == 0.004


def test_unknown_command(capsys):
    assert cli.main(["sfft"]) == 2
    assert "did you mean 'sft'" in capsys.readouterr().err


def test_prepare_tiny(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["prepare-tiny", str(out), "--num-sft", "10", "--num-pairs", "10", "--num-prompts", "10"]) == 0
    assert (out / "tokenizer" / "tokenizer.json").exists()
    assert sum(1 for _ in open(out / "sft.jsonl")) == 10


def test_subprocess_error_has_no_traceback(tmp_path):
    """The real entry point: `python -m megatron_rlhf.cli` with a missing config file."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf.cli", "sft", str(tmp_path / "missing.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: config file '{tmp_path / 'missing.yaml'}' not found (cwd: {ROOT}): pass an existing YAML file"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["sft", "--help"], ["rm", "--help"], ["sft", "--print-config"]])
def test_help_does_not_import_torch(argv):
    """--help answers at once: torch (seconds to import) is imported only by commands that run."""
    code = ("import sys; from megatron_rlhf import cli\n"
            "try:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'megatron.core', 'datasets', 'transformers') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:] + proc.stderr[-2000:]
