"""A rank whose peer process is gone (kill -9) ends with PEER_LOST_EXIT and at most one line, and skips the
interpreter's shutdown: gloo's threads of the broken group, destroyed there, could abort the process
("terminate called without an active exception", SIGABRT), and the launcher would then report that abort
instead of the rank that was killed (test_preemption.py's kill -9 case under `megatron-rlhf launch`)."""

import subprocess
import sys

import pytest

from megatron_rlhf.parallel import lifetime
from megatron_rlhf.parallel.report import PEER_LOST_EXIT

RANK = r'''
import atexit, datetime, os, signal, sys, time
import torch, torch.distributed as dist
rank = int(sys.argv[1])
os.environ["RANK"] = str(rank)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
from megatron_rlhf import cli
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
try:
    for _ in range(3000):
        dist.all_reduce(torch.ones(4))
        time.sleep(0.01)
except RuntimeError as e:
    sys.exit(cli._lost_peer(e))
sys.exit(3)  # the peer's death went unnoticed
'''


@pytest.mark.parametrize("under_launcher", [False, True])
def test_a_rank_that_lost_its_peer_exits_at_once(tmp_path, under_launcher):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    if under_launcher:
        env[lifetime.LAUNCHER_ENV] = "1"
    store = str(tmp_path / "store")
    victim = subprocess.Popen([sys.executable, str(script), "1", store], env=env)
    survivor = subprocess.run([sys.executable, str(script), "0", store], env=env, capture_output=True, text=True,
                              timeout=120)
    victim.wait(timeout=60)
    out = survivor.stdout + survivor.stderr
    assert survivor.returncode == PEER_LOST_EXIT, out
    assert "interpreter shutdown ran" not in out and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert lines == ([] if under_launcher else [
        "error: rank 0 lost its connection to another rank, whose process is gone (killed, or failed: its own "
        "output says why); a rerun resumes from the latest checkpoint"]), out
