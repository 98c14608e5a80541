"""One error line per job even on a loaded machine (issue 22, tests that stay green under load): a rank that
meets the job's error before rank 0 does waits for rank 0's post long enough that seconds of skew between the
ranks (load average 5-14 on two cores) do not print the line twice. A fake clock: nothing really waits."""

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
