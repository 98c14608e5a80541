"""Checkpoints a run must not lose (issue 22, items 1-4): pruning keeps what this run just wrote and never
touches another run's steps; a fresh start refuses a directory holding checkpoints unless told to move them
aside; a stage refuses another stage's checkpoints; one run per run directory; a full disk leaves one line,
the previous checkpoint intact and no partial directory. A world of one rank, in process."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlhf.checkpoint import run_dir
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.trainer.run import resume_point
from tests.unit.test_checkpoint_damage import _models

ROOT = Path(__file__).resolve().parents[2]


def _save(root, step, run, keep_last=2, models=None):
    return ckpt.save_checkpoint(root, step, models or _models(), {}, {}, {}, keep_last=keep_last, run=run)


def _steps(root):
    return run_dir.step_dirs(root)


def test_prune_keeps_the_new_run_and_never_touches_another_runs_steps(world, tmp_path):
    root = tmp_path / "checkpoints"
    earlier = ckpt.RunRecord.new("sft")
    for step in (2, 4):
        _save(root, step, earlier)
    new = ckpt.RunRecord.new("sft")  # e.g. resume=never into a used run dir (overwrite refused at start)
    models = _models()
    _save(root, 1, new, models=models)
    assert ckpt.latest_checkpoint(root) == root / "step_00000001"  # the step just written survives
    assert _steps(root) == ["step_00000001", "step_00000002", "step_00000004"]
    for step in (3, 5):
        _save(root, step, new, models=models)
    # keep_last=2 of the new run (3, 5); the earlier run's 2 and 4 are not the new run's to remove
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000004", "step_00000005"]
    assert ckpt.read_run_record(root / "step_00000005") == new


def _cfg(run, resume="auto", overwrite=False, ckpt_dir=None):
    return SimpleNamespace(
        checkpoint=SimpleNamespace(resume=resume, load=None, dir=ckpt_dir, overwrite=overwrite),
        logging=SimpleNamespace(run_dir=str(run)), tokenizer=SimpleNamespace(allow_swap=False))


def _ctx(root, stage):
    return SimpleNamespace(ckpt_root=str(root), run=ckpt.RunRecord.new(stage), rank0=True, log=None)


def test_fresh_start_over_checkpoints_is_refused_unless_overwrite_moves_them_aside(world, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 4, ckpt.RunRecord.new("ppo"))
    with pytest.raises(ckpt.CheckpointError, match=r"logging.run_dir: .* already holds checkpoints of an earlier "
                                                     r"run \(step_00000004\).*checkpoint.overwrite=true"):
        resume_point(_cfg(tmp_path / "run", resume="never"), _ctx(root, "ppo"))
    assert resume_point(_cfg(tmp_path / "run", resume="never", overwrite=True), _ctx(root, "ppo")) is None
    assert _steps(root) == [] and not (root / "latest").exists()
    (aside,) = root.glob("replaced-*")
    assert (aside / "step_00000004" / "metadata.json").exists() and (aside / "latest").exists()


def test_a_stage_refuses_another_stages_checkpoints(world, tmp_path):
    root = tmp_path / "sft_checkpoints"
    sft = ckpt.RunRecord.new("sft")
    _save(root, 6, sft)
    for resume in ("auto", "never"):
        with pytest.raises(ckpt.CheckpointError, match=r"checkpoint.dir: .*sft_checkpoints holds sft checkpoints "
                                                         r"\(step_00000006\), not ppo ones"):
            resume_point(_cfg(tmp_path, resume=resume, overwrite=True, ckpt_dir=root), _ctx(root, "ppo"))
    assert (root / "latest").read_text().strip() == "step_00000006"  # untouched, even with overwrite
    ctx = _ctx(root, "sft")  # its own stage resumes, and continues that run (pruning its older steps)
    assert resume_point(_cfg(tmp_path, ckpt_dir=root), ctx) == root / "step_00000006"
    assert ctx.run == sft


_HOLD = ("import sys, time; from megatron_rlhf.checkpoint import run_dir; "
         "assert run_dir.lock_dir(sys.argv[1], 'logging.run_dir') is None; print('locked', flush=True); time.sleep(600)")


def test_one_run_per_run_directory_and_a_dead_holders_lock_is_free(tmp_path):
    d = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(d)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"  # waits for the event, no fixed sleep
        busy = run_dir.lock_dir(str(d), "logging.run_dir")
        assert busy is not None and f"is in use by another run (pid {holder.pid} on host " in busy, busy
        assert busy.startswith(f"logging.run_dir='{d}'") and "choose another logging.run_dir" in busy
        holder.kill()  # kill -9: the lock it leaves is stale and must not block the next run
        holder.wait(timeout=60)
        assert run_dir.lock_dir(str(d), "logging.run_dir") is None
        assert f"pid {os.getpid()} " in (d / run_dir.LOCK_FILE).read_text()
    finally:
        holder.kill()
        run_dir.release_all()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only: CI runs as root), unmounted whatever the test does."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_full_disk_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(world, small_disk):
    root = small_disk / "checkpoints"
    run, models = ckpt.RunRecord.new("sft"), _models()
    _save(root, 2, run, models=models)
    used = sum(f.stat().st_size for f in (root / "step_00000002").rglob("*") if f.is_file())
    free = ckpt.shutil.disk_usage(small_disk).free
    with open(small_disk / "filler", "wb") as f:  # leave room for half a checkpoint
        f.write(b"\0" * max(0, free - used // 2))
    with pytest.raises(ckpt.CheckpointError) as e:
        _save(root, 4, run, models=models)
    assert str(e.value).startswith(f"no space left on {root} while saving step 4; {root / 'step_00000002'} is "
                                   "intact"), e.value
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]  # no partial .tmp-step_*
    assert ckpt.latest_checkpoint(root) == root / "step_00000002"
    ckpt.load_checkpoint(root / "step_00000002", _models(), {}, {})
    (small_disk / "filler").unlink()
    _save(root, 4, run, models=models)  # with room again the same save goes through
    assert ckpt.latest_checkpoint(root) == root / "step_00000004"
