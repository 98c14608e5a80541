"""A rank that stops making progress ends the job in bounded time, with one line naming it.

Gloo's process-group timeout does not end a job in which one rank is stuck outside any collective (a
scorer blocked on a lock, a dead NFS read): the other ranks wait in theirs forever, and a SIGTERM only
sets a flag that nobody reads. So each rank runs a daemon thread that samples its main thread's stack
once a second:

- the innermost frame staying the same frame at the same instruction means no progress;
- a rank whose main thread waits inside a `torch.distributed` collective for longer than `parallel.timeout_s`
  (a tenth of it, at least 10 s, once a stop was requested) declares the job wedged.

Every rank posts where it is in the job's TCP store every few seconds, so the rank that declares the job
wedged can name the rank the others wait for (the one not in a collective) and where it is. The first
verdict wins (compare-and-set); the rank that posted it prints `error: <line>`, and every rank's thread
then ends its process with exit code 124.

Stop signals are seen here too, through `signal.set_wakeup_fd`: Python runs a signal handler only when the
main thread next executes bytecode, which a rank wedged in C (a gloo wait) never does. A stop request
shortens the limit; a second Ctrl-C (more than `REPEAT_S` after the first: one Ctrl-C reaches a rank twice
under `megatron-rlhf launch`, from the terminal and forwarded) exits at once, without a checkpoint.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 124  # as timeout(1): the job ran out of time, not into bad input
REPEAT_S = 2.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_PREFIX = "megatron_rlhf/watchdog/"
_VERDICT = _PREFIX + "verdict"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Collectives only: a long write inside torch.distributed.checkpoint is work, not a wait.
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_current: Optional["Watchdog"] = None


def _library_dirs() -> tuple:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)})


_LIBRARY = _library_dirs()


def _where(frame) -> str:
    """`file:line (function)` of the innermost frame outside the standard library and installed packages (the
    code that is stuck or waits), preceded by the innermost frame of this package when that is another one."""
    def fmt(f):
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE):
            path = os.path.relpath(path, os.path.dirname(_PACKAGE))
        return f"{path}:{f.f_lineno} ({f.f_code.co_name})"

    user = ours = None
    f = frame
    while f is not None and ours is None:
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE):
            ours = f
        if user is None and (ours is f or not path.startswith(_LIBRARY)):
            user = f
        f = f.f_back
    user = user or frame
    return fmt(user) if ours is None or ours is user else f"{fmt(ours)}, at {fmt(user)}"


def _in_collective(frame) -> Optional[str]:
    """The torch.distributed function the main thread waits in (outermost such frame), or None."""
    name = None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D):
            name = frame.f_code.co_name
        frame = frame.f_back
    return name


class Watchdog:
    """The per-rank thread of the module docstring. `start()` once the process group exists."""

    def __init__(self, limit_s: float, interval_s: float = 1.0, post_every_s: float = 3.0):
        import torch.distributed as dist

        self.limit_s, self.interval_s, self.post_every_s = float(limit_s), interval_s, post_every_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.stop_requested_at: Optional[float] = None
        self._first_sigint: Optional[float] = None
        self._main = threading.main_thread().ident
        self._wakeup = self._signal_pipe()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-rlhf-watchdog", daemon=True)

    @staticmethod
    def _signal_pipe() -> Optional[int]:
        """The read end of a pipe the interpreter writes each signal number into (None if the process
        already has a wakeup fd, e.g. an asyncio loop, or this is not the main thread)."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return None
        return r

    def _read_signals(self) -> None:
        if self._wakeup is None:
            return
        try:
            received = os.read(self._wakeup, 512)
        except BlockingIOError:
            return
        now = time.monotonic()
        for signum in received:
            if signum not in _STOP_SIGNALS:
                continue
            if self.stop_requested_at is None:
                self.stop_requested_at = now
            if signum == signal.SIGINT:
                if self._first_sigint is not None and now - self._first_sigint > REPEAT_S:
                    if self.rank == 0:
                        print("error: a second Ctrl-C: exiting without a checkpoint (a rerun resumes from the "
                              "last one)", file=sys.stderr, flush=True)
                    os._exit(128 + signum)
                self._first_sigint = self._first_sigint or now

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            os.close(signal.set_wakeup_fd(-1))
            os.close(self._wakeup)
            self._wakeup = None

    def limit(self) -> float:
        if self.stop_requested_at is None:
            return self.limit_s
        return min(self.limit_s, max(10.0, self.limit_s / 10))

    def _run(self) -> None:
        last, last_lasti, stalled, posted, store_gone = None, None, 0.0, 0.0, False
        import torch.distributed as dist

        while not self._closed.wait(self.interval_s):
            if not dist.is_initialized():  # the process group went away without stop(): nothing left to watch
                return
            self._read_signals()
            frame = sys._current_frames().get(self._main)
            if frame is None:
                return
            if frame is last and frame.f_lasti == last_lasti:
                stalled += self.interval_s
            else:
                stalled = 0.0
            last, last_lasti = frame, frame.f_lasti  # a reference: a new call cannot reuse this frame's identity
            collective = _in_collective(frame)
            now = time.monotonic()
            try:
                if store_gone:  # nobody to tell: a main thread that still makes no progress ends its process
                    if collective and stalled >= self.limit():
                        self._exit(acknowledge=False)
                    continue
                if self.store.check([_VERDICT]):
                    self._exit()  # another rank declared the job wedged
                if now - posted >= self.post_every_s:
                    self._post(collective, frame, stalled)
                    posted = now
                if collective and stalled >= self.limit():
                    self._declare(collective, frame, stalled)
            except Exception:  # noqa: BLE001 - the store's host is gone (rank 0, or torchrun's agent when it died)
                # A rank that still makes progress carries on: under torchrun the store dies with the agent,
                # and the ranks' parent-death SIGTERM must still end in a checkpoint, not in an exit here.
                store_gone = True
            finally:
                del frame

    def _post(self, collective: Optional[str], frame, stalled: float) -> None:
        state = {"collective": collective, "where": _where(frame), "stalled": stalled}
        self.store.set(f"{_PREFIX}{self.rank}", json.dumps(state))

    def _states(self) -> dict:
        out = {}
        for r in range(self.world):
            key = f"{_PREFIX}{r}"
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def _declare(self, collective: str, frame, stalled: float) -> None:
        self._post(collective, frame, stalled)
        states = self._states()
        culprits = [r for r, s in states.items() if not s["collective"]]
        silent = [r for r in range(self.world) if r not in states]
        waited = f"{int(stalled)} s"
        if culprits:
            r = culprits[0]
            line = (f"rank {r} made no progress for {waited} in {states[r]['where']} while the other ranks "
                    f"waited for it (rank {self.rank} in {collective} at {_where(frame)})")
        elif silent:
            line = (f"rank {silent[0]} stopped reporting while rank {self.rank} waited {waited} for it in "
                    f"{collective} at {_where(frame)}")
        else:
            line = ("every rank waits in a collective that the others do not join: " + "; ".join(
                f"rank {r} in {s['collective']} at {s['where']}" for r, s in sorted(states.items())))
        if self.stop_requested_at is not None:
            line += "; a stop was requested and could not be honoured"
        line += ": the job is ended (parallel.timeout_s sets how long a rank may wait)"
        if self.store.compare_set(_VERDICT, "", line).decode() == line:  # the first verdict is the one printed
            print(f"error: {line}", file=sys.stderr, flush=True)
        self._exit()

    def _exit(self, acknowledge: bool = True) -> None:
        """End this process with EXIT_CODE, silently: the verdict is printed once, and what the main thread
        says when its peers vanish (gloo's "connection closed by peer") is noise. Rank 0 holds the store, so it
        goes last: it waits (a few seconds at most) until every other rank has seen the verdict."""
        import atexit

        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        atexit.register(os._exit, EXIT_CODE)  # should the main thread get to exit first, with whatever code
        if acknowledge:
            try:
                self.store.set(f"{_PREFIX}seen/{self.rank}", "1")
                if self.rank == 0:
                    others = [f"{_PREFIX}seen/{r}" for r in range(1, self.world)]
                    deadline = time.monotonic() + 5
                    while others and not self.store.check(others) and time.monotonic() < deadline:
                        time.sleep(0.1)
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
                pass
        os._exit(EXIT_CODE)


def start(limit_s: float) -> Watchdog:
    """Start this rank's watchdog (replacing an earlier one of this process). It is stopped at the latest when
    the interpreter exits: a daemon thread still inside the job's TCP store (a pybind11 call that released the
    GIL) while Python finalises is ended by `pthread_exit` within a C++ destructor, and `std::terminate`
    aborts the process ("terminate called without an active exception", exit 134), e.g. a caller that used
    `parallel.init.initialize` without `destroy`. atexit handlers run before finalisation starts."""
    global _current
    stop()
    _current = Watchdog(limit_s).start()
    return _current


def stop() -> None:
    """Stop this rank's watchdog before the process group goes away."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


atexit.register(stop)  # see start(); a no-op in a process that never started one
