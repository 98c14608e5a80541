"""Under torchrun a bad-input error is one `error:` line for the whole job (rank 0), exit code 2,
no traceback: before the process group exists (layout), after it (data), and for a checkpoint file
that only rank 1 reads (its RNG state), which every rank must agree on."""

import os
import re
import sys

from tests.distributed.launch import CLI, child_env, run_reaped
from tests.distributed.stages import overrides, run_cli


def _error_lines(proc):
    lines = [l for l in proc.stderr.splitlines() if re.search(r"(^|\]:)\s*error: ", l)]
    # No rank prints a traceback (torchrun's own ChildFailedError report stays; see megatron_rlhf/launch.py).
    assert not re.search(r"^\[rank\d+\]:\s*Traceback", proc.stderr, re.M), proc.stderr[-3000:]
    return lines


def test_layout_error_is_printed_once(data, tmp_path):  # noqa: F811
    proc = run_cli("sft", overrides(data, tmp_path / "run", **{"parallel.tp": 3}), nproc=2, check=False)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "not divisible by tp*pp*cp" in lines[0], proc.stderr[-3000:]


def test_under_megatron_rlhf_launch_an_error_is_the_only_output(data, tmp_path):  # noqa: F811
    args = overrides(data, tmp_path / "run", **{"parallel.tp": 3})
    proc = run_reaped([sys.executable, str(CLI), "launch", "--nproc-per-node", "2", "sft", *args],
                      env=child_env(), timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: world size 2 is not divisible by tp*pp*cp = 3*1*1 = 3: change parallel.tp/pp/cp or the number of ranks"]


def test_data_error_after_init_is_printed_once(data, tmp_path):  # noqa: F811
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    proc = run_cli("sft", overrides(data, tmp_path / "run", **{"data.train_path": empty}), nproc=2, check=False)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "no rows" in lines[0], proc.stderr[-3000:]


def test_damaged_rng_file_of_rank_1_is_reported_once_by_every_rank(data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    run_cli("sft", overrides(data, run, **{"train.train_steps": 2}), nproc=2)
    step = run / "checkpoints" / "step_00000002"
    os.truncate(step / "rng" / "rank00001.pt", 10)
    proc = run_cli("sft", overrides(data, run, **{"train.train_steps": 4}), nproc=2, check=False)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and f"checkpoint {step} is damaged (rng/rank00001.pt" in lines[0], proc.stderr[-3000:]
