"""Process lifetimes: ranks that outlive their launcher, helpers that outlive their rank.

- A rank started by a launcher (torchrun, `megatron-rlhf launch`) asks the kernel for SIGTERM when
  the launcher dies (`PR_SET_PDEATHSIG`): a launcher killed by a preemption signal it does not
  handle (torchrun and SIGUSR1 exit 138) then leaves ranks that save a checkpoint and exit 0,
  instead of orphans training on until the end.
- Megatron's `dist_checkpointing` would start a `spawn` multiprocessing manager per rank for its
  write-results queue. Our saves are synchronous, so that queue is a thread queue in the rank instead
  (`keep_checkpoint_results_in_process`): no manager process to outlive the rank, and no 2.4 s at a
  rank's first save while the manager imports torch to unpickle the results.
- Megatron's checkpoint writer forks worker processes (`filesystem_async`, `fork` context). A worker
  orphaned mid-write can block forever on a results pipe whose other end it holds itself, and it
  keeps the rank's resource tracker alive (the tracker exits on EOF from every holder of its pipe).
  Every process forked from a rank's main thread therefore gets SIGKILL when the rank dies.
- Stop signals (SIGTERM, SIGUSR1) are caught first thing in a rank (`catch_stop_signals`, from the CLI's
  entry point) and ignored once it exits: one during start-up or after the final checkpoint neither kills
  the rank nor fails the job.
Linux only (prctl); elsewhere these are no-ops.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LAUNCHER_ENV = "MEGATRON_RLHF_LAUNCHER"  # set by megatron_rlhf.launch to its pid
# Set by megatron_rlhf.launch: a file where a rank notes its checkpoint root, so that the launcher, when a rank
# is killed, can say which checkpoint a rerun resumes from (the ranks that knew are gone by then).
CHECKPOINT_NOTE_ENV = "MEGATRON_RLHF_CHECKPOINT_NOTE"
_forker = None  # (pid, forked from the main thread) of the process that is forking now


def prctl(option: int, value: int) -> bool:
    """prctl(option, value); False where it is unavailable (not Linux) or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int, parent_pid: Optional[int] = None) -> bool:
    """Get `sig` when the parent process dies; if it is already gone, get it now."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if not prctl(PR_SET_PDEATHSIG, sig):
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


def note_checkpoint_root(root: str) -> None:
    """Tell `megatron-rlhf launch` where this run's checkpoints go (a no-op without it; first local rank only)."""
    path = os.environ.get(CHECKPOINT_NOTE_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(os.path.abspath(root) + "\n")
    os.replace(tmp, path)


def resume_point_of(note: str) -> Optional[str]:
    """What a rerun resumes from, in words, after the run that wrote `note` died; None if it never wrote one."""
    try:
        with open(note) as f:
            root = f.read().strip()
    except OSError:
        return None
    try:
        with open(os.path.join(root, "latest")) as f:
            return f"a rerun resumes from {os.path.join(root, f.read().strip())}"
    except OSError:
        return f"no checkpoint was written yet in {root}: a rerun starts from the beginning"


def launched_by_launcher() -> bool:
    return LAUNCHER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher() -> None:
    """In a rank: SIGTERM (= save a checkpoint and exit) when the launcher that started us dies."""
    if launched_by_launcher():
        die_with_parent(signal.SIGTERM)


def _before_fork() -> None:
    global _forker
    _forker = (os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    pid, from_main_thread = _forker
    # PDEATHSIG fires when the forking *thread* exits: only the main thread lives as long as the rank.
    if from_main_thread:
        die_with_parent(signal.SIGKILL, pid)


def forked_children_die_with_rank() -> None:
    """Every process later forked from this process's main thread gets SIGKILL when this process dies.

    Registered once per process; `multiprocessing`'s spawn and `subprocess` start programs with
    fork+exec outside these hooks, so launched programs are not affected.
    """
    if getattr(forked_children_die_with_rank, "_registered", False):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    forked_children_die_with_rank._registered = True


def keep_checkpoint_results_in_process() -> None:
    """dist_checkpointing's write-results queue as a thread queue in this rank (module docstring).

    Megatron creates it on first use as a `spawn` `Manager().Queue()`: a server process that imports torch
    to unpickle the results (the rank waits ~2.4 s at its first save) and must not outlive the rank. Our
    saves are synchronous (`AsyncRequest.execute_sync`: the put and the get both happen in the rank); an
    asynchronous save would need the cross-process queue back."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = queue.Queue()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Slurm's preemption / time-limit warning, a terminal's kill
_stop = {"requested": False, "installed": False}


def _note_stop(signum, frame) -> None:
    _stop["requested"] = True


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def catch_stop_signals() -> None:
    """First thing in a training rank: SIGTERM / SIGUSR1 only note a stop request (`stop_requested()`,
    read after each step by trainer/run.StopFlag) from here on, through the imports, process groups,
    data, model build and checkpoint load that come before the first step; the default action would
    kill the rank (exit 138) and fail the job instead of requeueing it. They are unblocked here (the
    launcher starts ranks with them blocked, so one sent before this line waits instead of killing).
    At exit they are ignored: Python's shutdown puts the default handlers back, and a late signal
    (a time limit while a finished job exits) must not turn a finished run into exit 138."""
    if not _stop["installed"]:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _note_stop)
        atexit.register(_ignore_stop_signals)
        _stop["installed"] = True
    unblock_stop_signals()


def stop_requested() -> bool:
    return _stop["requested"]


def block_stop_signals() -> None:
    """In a launcher's child before exec: stop signals wait (pending) until the rank catches them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def unblock_stop_signals() -> None:
    """Commands that do not checkpoint get the default actions back (a pending stop signal ends them now)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
