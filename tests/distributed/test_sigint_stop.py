"""Ctrl-C is a stop request (issue 22): SIGINT to the launcher's process group, as a terminal sends it, saves
a checkpoint and exits 0 on every rank, with no KeyboardInterrupt (a second Ctrl-C: test_wedged_rank.py)."""

import os
import signal

from tests.distributed.stages import losses
from tests.distributed.test_preemption import _launch, _steps


def test_ctrl_c_saves_and_exits_zero_and_a_second_one_exits_at_once(data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    job = _launch(data, run, tmp_path / "log")
    job.wait_for(_steps(run))
    os.killpg(job.proc.pid, signal.SIGINT)  # the terminal: launcher and ranks at once
    rc, alive = job.finish()
    out = job.output()
    assert rc == 0 and not alive, (rc, alive, out[-3000:])
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out[-3000:]
    assert out.count("stop requested: saved checkpoint") == 1, out[-3000:]
    stopped = max(losses(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"

