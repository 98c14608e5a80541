"""A rank that stops making progress ends the job in bounded time (issue 22, item 5): one `error:` line names
the rank and where it is stuck, every rank exits; a SIGTERM to such a job ends it well before the limit."""

import os
import signal
import subprocess
import sys
import time

from megatron_rlhf.parallel.watchdog import REPEAT_S
from tests.distributed.launch import ROOT, SCRIPTS, child_env, free_port

LIMIT_S = 12  # parallel.timeout_s of the job
SCRIPT = SCRIPTS / "wedged_rank.py"
STUCK_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "Event().wait()" in line)


def _job(tmp_path, limit_s):
    """Both ranks in one new process group (as a launcher starts them); (procs, logs, ready())."""
    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"})
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    for r in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), str(limit_s), str(tmp_path / "ready")], cwd=ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=open(logs[r], "w"), stderr=subprocess.STDOUT,
            process_group=0 if r == 0 else procs[0].pid))
    ready = lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2))  # noqa: E731
    return procs, logs, ready


def _wait(procs, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    return [p.poll() for p in procs]


def _run(tmp_path, limit_s, signals=()):
    procs, logs, ready = _job(tmp_path, limit_s)
    try:
        assert _wait_for(ready, procs, 600), [log.read_text()[-2000:] for log in logs]
        wedged_at = time.monotonic()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(REPEAT_S + 0.5)  # a second press, not the first one's echo
            os.killpg(procs[0].pid, sig)
        codes = _wait(procs, limit_s + 300)
        return codes, time.monotonic() - wedged_at, [log.read_text() for log in logs]
    finally:
        try:
            os.killpg(procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(cond, procs, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_a_wedged_rank_ends_the_job_naming_it(tmp_path):
    codes, took, outs = _run(tmp_path, LIMIT_S)
    assert codes == [124, 124], (codes, outs)
    assert LIMIT_S <= took < LIMIT_S + 90, took  # bounded; the margin is for a loaded machine
    errors = [line for out in outs for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, outs
    assert errors[0].startswith("error: rank 1 made no progress for "), errors
    assert f"wedged_rank.py:{STUCK_LINE} (score)" in errors[0] and "rank 0 in all_reduce" in errors[0], errors
    assert "unreachable" not in "".join(outs) and "Traceback" not in "".join(outs), outs


def test_sigterm_ends_a_wedged_job_before_the_limit(tmp_path):
    codes, took, outs = _run(tmp_path, 200, signals=[signal.SIGTERM])
    assert codes == [124, 124] and took < 100, (codes, took, outs)  # a tenth of the limit (20 s), not all of it
    errors = [line for out in outs for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1 made no progress" in errors[0], outs
    assert "a stop was requested and could not be honoured" in errors[0], errors


def test_a_second_ctrl_c_exits_a_wedged_job_at_once(tmp_path):
    codes, took, outs = _run(tmp_path, 200, signals=[signal.SIGINT, signal.SIGINT])
    # 130, not the 124 a single stop request gives after 20 s: the second press ended it at once
    assert codes == [130, 130] and took < 60, (codes, took, outs)
    assert outs[0].strip() == "error: a second Ctrl-C: exiting without a checkpoint (a rerun resumes from the last one)"
    assert outs[1].strip() == "", outs
