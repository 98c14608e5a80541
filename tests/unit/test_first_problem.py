"""`parallel.report.first_problem`: a check that fails on one rank fails on every rank, with the lowest failing
rank's words (the collective behind a damaged RNG file, a failed save, an invalid sharding, a gold scorer that
fails on one rank)."""

import subprocess
import sys

from megatron_rlhf.parallel.report import first_problem, from_every_rank

RANK = r'''
import datetime, sys
import torch.distributed as dist
from megatron_rlhf.parallel.report import first_problem, from_every_rank
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=3,
                        timeout=datetime.timedelta(seconds=60))
problem = {0: None, 1: "rank 1 is out of disk", 2: "rank 2 too"}[rank]
print(repr(first_problem(problem)), repr(first_problem("" if rank else None)), from_every_rank(rank * 10), flush=True)
dist.destroy_process_group()
'''


def test_every_rank_sees_the_lowest_ranks_problem(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    store = str(tmp_path / "store")
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0, 0], outs
    assert [o.strip().splitlines()[-1] for o in outs] == ["'rank 1 is out of disk' None [0, 10, 20]"] * 3, outs


def test_without_a_process_group_a_rank_sees_its_own():
    assert first_problem("bad") == "bad" and first_problem("") is None and first_problem(None) is None
    assert from_every_rank({"a": 1}) == [{"a": 1}]
