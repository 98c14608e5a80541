"""`megatron-rlhf launch` over stand-in ranks: each gets OMP_NUM_THREADS = CPUs / ranks per node (1 to 8) unless the
user set it (2 ranks that each start a thread per core oversubscribe a 2-core machine: a PPO step ran 5-10x
slower), and a rank killed by a signal is named even when every rank had ended before the launcher first looked."""

from types import SimpleNamespace

import pytest

from megatron_rlhf import launch


@pytest.mark.parametrize("cpus,ranks,threads", [(2, 2, 1), (2, 1, 2), (16, 2, 8), (64, 8, 8), (16, 4, 4), (4, 8, 1)])
def test_threads_per_rank(monkeypatch, cpus, ranks, threads):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert launch.threads_per_rank(ranks) == threads


def _launch(monkeypatch, returncodes, cpus=6):
    """launch.main over ranks that have already ended with `returncodes`; -> (exit code, envs of the ranks)."""
    started = []

    def popen(cmd, env, preexec_fn):
        rc = returncodes[len(started)]
        started.append(env)
        return SimpleNamespace(pid=100 + len(started), returncode=rc, poll=lambda: rc)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(launch.lifetime, "prctl", lambda *a: 0)
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    monkeypatch.setattr(launch, "_kill_leftovers", lambda: None)
    return launch.main(["--nproc-per-node", str(len(returncodes)), "sft", "x.yaml"]), started


@pytest.mark.parametrize("user", [None, "5"])
def test_the_ranks_get_it_unless_the_user_set_it(monkeypatch, user):
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    code, started = _launch(monkeypatch, [0, 0])
    assert code == 0
    assert [env["OMP_NUM_THREADS"] for env in started] == [user or "3"] * 2
    assert [env["RANK"] for env in started] == ["0", "1"]


def test_a_killed_rank_is_named_when_all_ended_between_two_polls(monkeypatch, capsys):
    """kill -9 of rank 1, and rank 0's quick exit on its lost peer, both before the launcher polls."""
    from megatron_rlhf.parallel.report import PEER_LOST_EXIT

    code, _ = _launch(monkeypatch, [PEER_LOST_EXIT, -9])
    assert code == 137
    assert capsys.readouterr().err.startswith("error: rank 1 (pid 102) was killed by SIGKILL; the job is ended")
