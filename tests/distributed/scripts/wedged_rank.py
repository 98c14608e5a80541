"""A job with one wedged rank (issue 22, item 5): rank 1 blocks outside any collective, as a gold scorer that
waits on a lock would; rank 0 waits for it in an all_reduce. The watchdog must end the job.

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python wedged_rank.py TIMEOUT_S READY_FILE
Each rank touches READY_FILE.<rank> once it is about to wedge (or wait), with a StopFlag installed as the
training loops have it.
"""

import sys
import threading
from pathlib import Path

import torch

from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.run import StopFlag


def score(prompts):
    threading.Event().wait()  # never returns: a scorer blocked on a lock nobody releases


def main(timeout_s: str, ready: str):
    init.initialize(ParallelConfig(timeout_s=int(timeout_s)))
    stop = StopFlag()
    rank = torch.distributed.get_rank()
    torch.distributed.barrier()
    Path(f"{ready}.{rank}").touch()
    if rank == 1:
        score(["1 2 3"])
    stop.any_rank()  # an all_reduce rank 1 never joins
    print("unreachable: the collective returned", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
