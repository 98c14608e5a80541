"""`megatron-rlhf launch`: N ranks of a megatron-rlhf command on one node, as `srun` starts them.

    megatron-rlhf launch --nproc-per-node 2 sft examples/tiny/sft.yaml train.train_steps=200
    # on each of M nodes (slurm/node.sh does this): ranks node_rank*N .. node_rank*N + N-1 of M*N
    megatron-rlhf launch --nnodes M --node-rank $SLURM_NODEID --nproc-per-node N \
        --master-addr FIRST_NODE --master-port 29500 ppo CONFIG.yaml

Why not torchrun: torchrun starts each rank in a session of its own, so a signal to the job's
process group (Slurm's preemption SIGUSR1, a terminal's SIGTERM) reaches only torchrun, which dies
of SIGUSR1 (exit 138) and leaves the ranks running; on any failure it adds a traceback of its own.
Here the ranks share the launcher's process group, so a group signal reaches every rank directly;
a signal sent to the launcher alone is forwarded to every rank. The ranks then agree at the end of
the step, save a checkpoint and exit 0, and so does the launcher.

Each rank gets OMP_NUM_THREADS = this node's CPUs / N (1 to 8) unless the environment sets it.

When a rank fails, the others get `--grace` seconds to report and exit, then are killed; the
launcher exits with the first failing rank's code (128 + signal for a signal). A rank that fails
prints its own error; a rank killed by a signal cannot, so the launcher prints one line naming it
and the checkpoint a rerun resumes from (noted by the ranks at start, `lifetime.note_checkpoint_root`),
while the ranks that lose their connection to it exit quietly (`report.PEER_LOST_EXIT`). The launcher is a child subreaper: helper processes a killed rank
leaves behind become its children and are killed when the job ends. If the launcher itself is
killed, each rank gets SIGTERM (parallel/lifetime.py) and saves a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from megatron_rlhf.parallel import lifetime
from megatron_rlhf.parallel.report import PEER_LOST_EXIT

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megatron-rlhf launch",
        description="Run N ranks of a megatron-rlhf command on this node (signals reach every rank).",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks to start")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job, one launcher each (Slurm: $SLURM_JOB_NUM_NODES)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (Slurm: $SLURM_NODEID)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (the first node)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds the other ranks get after one fails")
    p.add_argument("command", nargs=argparse.REMAINDER, help="megatron-rlhf command and its arguments")
    args = p.parse_args(list(argv))
    if args.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1 (got {args.nproc_per_node})")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and args.master_port is None:
        p.error("--master-port is needed with --nnodes > 1 (every node must use the same one)")
    if not args.command:
        p.error("give a megatron-rlhf command, e.g. sft CONFIG.yaml")
    return args


def threads_per_rank(ranks_per_node: int) -> int:
    """OMP_NUM_THREADS for ranks that do not set it: this process's CPUs / ranks on the node, at least 1, at most
    8 (slurm/env.sh's rule). Without it every rank starts one thread per core: 2 ranks x 2 threads on 2 cores
    oversubscribe, and a PPO step ran 5-10x slower."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // max(1, ranks_per_node)))


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # Popen reports death by signal N as -N


def _children() -> List:
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - without psutil only the ranks themselves are known
        return []


def _kill_leftovers() -> None:
    """SIGKILL every process still below us (orphaned helpers re-parented to us), then reap them."""
    for child in _children():
        try:
            child.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
            if not _children():
                return


def _report_lost_ranks(ranks: List[subprocess.Popen], died: Optional[int], first: int, resume: Optional[str]) -> None:
    """One line for what no rank could print: the rank killed by a signal (kill -9, the OOM killer), or, when
    every failing rank here only lost its connection, that the rank that vanished was on another node."""
    then = f", and {resume}" if resume else ""
    if died is not None:
        p = ranks[died]
        try:
            how = signal.Signals(-p.returncode).name
        except ValueError:  # a real-time signal has no name
            how = f"signal {-p.returncode}"
        print(f"error: rank {first + died} (pid {p.pid}) was killed by {how}; the job is ended{then}",
              file=sys.stderr, flush=True)
        return
    failed = [i for i, p in enumerate(ranks) if p.returncode != 0]
    if failed and all(ranks[i].returncode == PEER_LOST_EXIT for i in failed):
        who = (f"rank {first + failed[0]} lost its" if len(failed) == 1
               else f"ranks {', '.join(str(first + i) for i in failed)} lost their")
        print(f"error: {who} connection to a rank of another node, whose process is gone (that node's output says "
              f"why); the job is ended{then}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    lifetime.prctl(lifetime.PR_SET_CHILD_SUBREAPER, 1)
    n = args.nproc_per_node
    base = dict(os.environ, MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port or _free_port()),
                WORLD_SIZE=str(n * args.nnodes), LOCAL_WORLD_SIZE=str(n), **{lifetime.LAUNCHER_ENV: str(os.getpid())})
    base.setdefault("OMP_NUM_THREADS", str(threads_per_rank(n)))  # the user's setting wins
    notes = tempfile.mkdtemp(prefix="megatron-rlhf-launch-")
    base[lifetime.CHECKPOINT_NOTE_ENV] = os.path.join(notes, "checkpoint_root")
    cmd = [sys.executable, "-m", "megatron_rlhf.cli", *args.command]
    ranks: List[subprocess.Popen] = []

    def forward(signum, _frame):
        for p in ranks:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for r in range(n):
        rank = args.node_rank * n + r
        # Stop signals wait (blocked) in a new rank until its CLI catches them: one sent during its
        # interpreter's start-up is kept for the first step instead of killing it (exit 138).
        ranks.append(subprocess.Popen(cmd, env=dict(base, RANK=str(rank), LOCAL_RANK=str(r)),
                                      preexec_fn=lifetime.block_stop_signals))
    failed_at, code, killed, died = None, 0, set(), None
    while any(p.poll() is None for p in ranks):
        for i, p in enumerate(ranks):
            rc = p.poll()
            if rc not in (None, 0) and failed_at is None:
                failed_at, code = time.monotonic(), _exit_code(rc)
            if rc is not None and rc < 0 and died is None and i not in killed:
                died = i  # killed by a signal we did not send: it could not say so itself
        if failed_at is not None and time.monotonic() - failed_at > args.grace:
            for i, p in enumerate(ranks):
                if p.poll() is None:
                    killed.add(i)
                    p.kill()
        time.sleep(0.1)
    if died is None:  # the killed rank and the rest may all have ended between two polls of the loop
        died = next((i for i, p in enumerate(ranks) if p.returncode < 0 and i not in killed), None)
    if code == 0:
        code = next((_exit_code(p.returncode) for p in ranks if p.returncode != 0), 0)
    if died is not None:
        code = _exit_code(ranks[died].returncode)
    _report_lost_ranks(ranks, died, args.node_rank * n, lifetime.resume_point_of(base[lifetime.CHECKPOINT_NOTE_ENV]))
    shutil.rmtree(notes, ignore_errors=True)
    # Every rank has exited: nothing is left to forward to. A late stop signal (Slurm's time-limit SIGUSR1
    # while the job ends) must not kill the launcher with 138 once Python's exit restores the default handlers.
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    _kill_leftovers()
    return code


if __name__ == "__main__":
    sys.exit(main())
