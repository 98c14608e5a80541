"""A process forked from a rank dies with the rank (issue 12: an orphaned checkpoint writer blocked on
its results pipe and kept the rank's resource tracker alive after a `kill -9` of a rank started directly)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.distributed.launch import ROOT

PARENT = r"""
import multiprocessing, sys, threading, time
from megatron_rlhf.parallel import lifetime
if sys.argv[1] == "hook":
    lifetime.forked_children_die_with_rank()
def start():  # as Megatron's checkpoint writer starts its workers: the fork context
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    p.start()
    print(p.pid, flush=True)
if sys.argv[2] == "thread":
    t = threading.Thread(target=start); t.start(); t.join()
else:
    start()
time.sleep(120)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")


def _forked_child_after_kill_9(hook: str, where: str) -> psutil.Process:
    """Start a parent that forks a sleeper, `kill -9` the parent, return the sleeper (alive or not)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, hook, where], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 2  # PDEATHSIG is delivered at once; 2 s is ample
    while time.time() < deadline and _alive(child):
        time.sleep(0.05)
    return child


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(p: psutil.Process) -> None:
    try:
        p.kill()
    except psutil.Error:
        pass


def test_child_forked_from_the_main_thread_dies_with_its_parent():
    child = _forked_child_after_kill_9("hook", "main")
    alive = _alive(child)
    _reap(child)
    assert not alive


def test_without_the_hook_the_forked_child_outlives_its_parent():
    """The failure the hook fixes (and proof the test above can fail)."""
    child = _forked_child_after_kill_9("none", "main")
    alive = _alive(child)
    _reap(child)
    assert alive


def test_child_forked_from_a_short_lived_thread_is_not_killed_when_that_thread_ends():
    """PDEATHSIG follows the forking thread: a fork from another thread must not get it."""
    child = _forked_child_after_kill_9("hook", "thread")
    alive = _alive(child)
    _reap(child)
    assert alive
