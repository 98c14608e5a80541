"""A save whose sharding is invalid, on 2 ranks (DP=2): two distributed optimizers writing the same keys, as
checkpoint/optim_state.py's earlier "shared" keys did for PPO's policy and value. Megatron validates on rank 0
alone; every rank must raise the same CheckpointError at once, leave no partial step and keep `latest`.

Usage: torchrun --nproc_per_node=2 invalid_sharding_save.py OUT_DIR RESULT_JSON
"""

import json
import sys
import time
from pathlib import Path

import torch

from megatron_rlhf.checkpoint import optim_state
from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from tests.unit.trainables import checkpoint_objects, tiny_trainable, train_once


def main(out_dir: str, result: str):
    init.initialize(ParallelConfig(timeout_s=60), seed=1234)  # a hang ends in the watchdog's exit 124
    rank = torch.distributed.get_rank()
    policy, _ = tiny_trainable("float32", seed=0)
    value, _ = tiny_trainable("float32", seed=1)
    train_once(policy, 0)
    train_once(value, 1)
    root = Path(out_dir)
    ckpt.save_checkpoint(root, 1, *checkpoint_objects(policy=policy), {})  # a good one first: `latest` must stay on it
    optim_state.LAYOUT = {"format": "dp_reshardable", "keys": "shared"}
    start = time.monotonic()
    try:
        ckpt.save_checkpoint(root, 2, *checkpoint_objects(policy=policy, value=value), {})
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    took = time.monotonic() - start
    reports = [None, None]
    torch.distributed.all_gather_object(reports, {"error": error, "took": took})
    if rank == 0:
        Path(result).write_text(json.dumps({"ranks": reports, "latest": (root / "latest").read_text().strip(),
                                            "entries": sorted(p.name for p in root.iterdir())}))
    init.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
