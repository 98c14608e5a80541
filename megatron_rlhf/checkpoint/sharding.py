"""A save's sharding checked with one verdict on every rank.

Megatron-Core 0.16.1 checks a save's sharding (every shard of every tensor and object written exactly once) on
global rank 0 alone, after gathering every rank's shards, and raises there alone: the other ranks go on into
the write's collectives and wait for rank 0 until the job's timeout. Two optimizers writing the same keys
(checkpoint/optim_state.py) hung PPO's first save that way. `checked_on_every_rank` shares rank 0's verdict,
so that every rank raises the same error before anything is written, and the save fails in one line.
"""

from __future__ import annotations

import contextlib

from megatron_rlhf.parallel.report import first_problem


@contextlib.contextmanager
def checked_on_every_rank():
    """While saving with `dist_checkpointing.save`: its sharding validation raises on every rank or on none."""
    from megatron.core.dist_checkpointing import state_dict_utils
    from megatron.core.dist_checkpointing.core import CheckpointingException

    original = state_dict_utils.validate_sharding_integrity

    def validate(global_metadata, common_state_dict=None):
        verdict = None
        try:
            original(global_metadata, common_state_dict=common_state_dict)
        except Exception as e:  # noqa: BLE001 - shared with every rank, then raised on each
            # megatron-core 0.19 says "Invalid sharding pattern validation. Errors: " and then a defect a line
            text = str(e).partition("Errors:")[2] or str(e)
            verdict = "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(e).__name__
        failed = first_problem(verdict)
        if failed is not None:
            raise CheckpointingException(f"invalid sharding: {failed}")

    state_dict_utils.validate_sharding_integrity = validate
    try:
        yield
    finally:
        state_dict_utils.validate_sharding_integrity = original
