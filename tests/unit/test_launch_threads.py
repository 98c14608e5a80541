"""`megatron-rlhf launch` gives each rank OMP_NUM_THREADS = CPUs / ranks per node (1 to 8) unless the user set it:
2 ranks that each start a thread per core oversubscribe a 2-core machine (a PPO step ran 5-10x slower)."""

from types import SimpleNamespace

import pytest

from megatron_rlhf import launch


@pytest.mark.parametrize("cpus,ranks,threads", [(2, 2, 1), (2, 1, 2), (16, 2, 8), (64, 8, 8), (16, 4, 4), (4, 8, 1)])
def test_threads_per_rank(monkeypatch, cpus, ranks, threads):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert launch.threads_per_rank(ranks) == threads


@pytest.mark.parametrize("user", [None, "5"])
def test_the_ranks_get_it_unless_the_user_set_it(monkeypatch, user):
    started = []

    def popen(cmd, env, preexec_fn):
        started.append(env)
        return SimpleNamespace(pid=100 + len(started), returncode=0, poll=lambda: 0)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setattr(launch.lifetime, "prctl", lambda *a: 0)
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    assert launch.main(["--nproc-per-node", "2", "sft", "x.yaml"]) == 0
    assert [env["OMP_NUM_THREADS"] for env in started] == [user or "3"] * 2
    assert [env["RANK"] for env in started] == ["0", "1"]
