"""One error line per job even on a loaded machine (issue 22, tests that stay green under load): a rank that
meets the job's error before rank 0 does waits for rank 0's post long enough that seconds of skew between the
ranks (load average 5-14 on two cores) do not print the line twice. A fake clock: nothing really waits. And the
line the launcher prints for a rank that could not print its own (killed by a signal)."""

from types import SimpleNamespace

from megatron_rlhf.parallel import report


class _Store:
    """Rank 0 posts `message` at `posted_at` seconds on the fake clock."""

    def __init__(self, clock, posted_at, message):
        self.clock, self.posted_at, self.message = clock, posted_at, message

    def check(self, keys):
        return self.clock.now >= self.posted_at

    def get(self, key):
        return self.message.encode()


def _rank1_prints(monkeypatch, posted_at, message="data x.jsonl: no rows", posted=None):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(report, "time", SimpleNamespace(monotonic=lambda: clock.now,
                                                        sleep=lambda s: setattr(clock, "now", clock.now + s)))
    monkeypatch.setattr(report, "_rank", lambda: 1)
    monkeypatch.setattr(report, "_store", lambda: _Store(clock, posted_at, posted or message))
    return report.should_print_error(message), clock.now


def test_rank_0_posting_seconds_late_still_prints_once(monkeypatch):
    prints, waited = _rank1_prints(monkeypatch, posted_at=8.0)  # rank 0 reached the same error 8 s later
    assert not prints and 8.0 <= waited < 9.0


def test_a_rank_failing_alone_is_still_heard(monkeypatch):
    assert _rank1_prints(monkeypatch, posted_at=1.0, posted="another error")[0]
    prints, waited = _rank1_prints(monkeypatch, posted_at=float("inf"))  # rank 0 never fails: say it ourselves
    assert prints and waited < 60


def test_the_launcher_names_a_killed_rank_or_the_other_node(tmp_path, capsys):
    """megatron-rlhf launch's line when no rank could print one (the kill -9 run itself: test_preemption.py)."""
    from megatron_rlhf import launch
    from megatron_rlhf.parallel import lifetime

    note = tmp_path / "note"
    assert lifetime.resume_point_of(str(note)) is None  # no rank noted a checkpoint root
    (tmp_path / "ckpt").mkdir()
    note.write_text(f"{tmp_path / 'ckpt'}\n")
    assert lifetime.resume_point_of(str(note)) == (f"no checkpoint was written yet in {tmp_path / 'ckpt'}: a rerun "
                                                   "starts from the beginning")
    (tmp_path / "ckpt" / "latest").write_text("step_00000004\n")
    resume = lifetime.resume_point_of(str(note))
    assert resume == f"a rerun resumes from {tmp_path / 'ckpt' / 'step_00000004'}"

    ranks = [SimpleNamespace(pid=11, returncode=report.PEER_LOST_EXIT), SimpleNamespace(pid=12, returncode=-9)]
    launch._report_lost_ranks(ranks, 1, 2, resume)  # node 1 of a 2x2 job: its ranks are 2 and 3
    launch._report_lost_ranks(ranks[:1], None, 0, None)  # every failure here a lost peer: the dead one was elsewhere
    launch._report_lost_ranks([SimpleNamespace(pid=13, returncode=2)], None, 0, resume)  # it spoke for itself
    assert capsys.readouterr().err.splitlines() == [
        f"error: rank 3 (pid 12) was killed by SIGKILL; the job is ended, and {resume}",
        "error: rank 0 lost its connection to a rank of another node, whose process is gone (that node's output "
        "says why); the job is ended"]
