"""A run directory that cannot be written is one ConfigError line, before data loading and model
building (checked here with data that would fail to load if the check came later)."""

import os
import uuid

import pytest

from megatron_rlhf import cli
from megatron_rlhf.trainer.preflight import check_writable_dir


@pytest.fixture
def args(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("")  # an empty file: loading it would be a DataError ("no rows")
    tok = tmp_path / "tok"
    tok.mkdir()  # not a tokenizer: loading it would be a DataError too
    return [f"data.train_path={data}", f"tokenizer.path={tok}", "logging.progress_bar=false"]


def _unwritable_dir(tmp_path) -> str:
    """A directory this process cannot create files in (root ignores permission bits: use /sys)."""
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    try:
        (d / "probe").touch()
    except OSError:
        return str(d / "run")
    os.chmod(d, 0o755)
    sys_dir = f"/sys/megatron-rlhf-test-{uuid.uuid4().hex[:8]}"
    try:
        os.mkdir(sys_dir)
    except OSError:
        return sys_dir + "/run"
    os.rmdir(sys_dir)
    pytest.skip("no unwritable directory available")


def test_run_dir_under_a_file(tmp_path, args, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert cli.main(["sft", *args, f"logging.run_dir={blocker}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: logging.run_dir='{blocker}/run' is inside '{blocker}', which is a file, not a directory: "
                   "choose another logging.run_dir"]


def test_read_only_run_dir(tmp_path, args, capsys):
    run_dir = _unwritable_dir(tmp_path)
    assert cli.main(["sft", *args, f"logging.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: logging.run_dir='{run_dir}' is not writable ("), err


def test_checkpoint_dir_is_checked_too(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(Exception, match="checkpoint.dir='.*' is a file, not a directory"):
        check_writable_dir(str(tmp_path / "f"), "checkpoint.dir")
    check_writable_dir(str(tmp_path / "new" / "deeper"), "checkpoint.dir")
    assert (tmp_path / "new" / "deeper").is_dir() and not os.listdir(tmp_path / "new" / "deeper")
