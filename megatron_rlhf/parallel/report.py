"""One error line per job, not one per rank.

Bad input is usually the same on every rank (the same config, data and checkpoint), so every rank
fails with the same message; only global rank 0 prints it. A rank that fails alone (or differently)
must still be heard: once the process group exists, rank 0 posts its message in the job's TCP store
and any other rank prints its own only when rank 0 has not posted the same one within 20 s (it returns at
rank 0's post: the limit is only waited out by a rank that fails alone).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

_KEY = "megatron_rlhf/error"


def _rank() -> int:
    env = os.environ
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def _store():
    if "torch.distributed" not in sys.modules:  # no process group can exist; do not import torch for nothing
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: fall back to "rank 0 prints"
        pass
    return None


def should_print_error(message: str, wait_s: float = 20.0) -> bool:
    """True on the rank that should print `message` (rank 0, or a rank whose failure rank 0 does not share).

    Other ranks wait (at most `wait_s`) before returning, so that a launcher tearing the job down
    when the first rank exits does not kill rank 0 before it has printed. They return as soon as rank 0
    posts; the limit is generous because on a loaded machine rank 0 can reach the same error seconds
    later, and only a rank failing alone waits it out.
    """
    store = _store()
    if _rank() == 0:
        if store is not None:
            try:
                store.set(_KEY, message)
            except Exception:  # noqa: BLE001 - printing matters more than posting
                pass
        return True
    if store is None:  # before the process group: the error comes from input every rank shares
        time.sleep(min(wait_s, 2.0))
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if store.check([_KEY]):
                return store.get(_KEY).decode() != message
        except Exception:  # noqa: BLE001 - rank 0 (the store's host) is gone: say it ourselves
            return True
        time.sleep(0.1)
    return True


def from_every_rank(obj: Any) -> List[Any]:
    """Every rank's `obj`, in rank order (collective over the world; `[obj]` without a process group)."""
    if "torch.distributed" not in sys.modules:
        return [obj]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def first_problem(problem: Optional[str]) -> Optional[str]:
    """The lowest rank's problem (None or "" where a rank has none), on every rank (collective), so that a
    check that fails on one rank raises the same error on all of them instead of leaving the others waiting
    in the next collective."""
    return next((p for p in from_every_rank(problem or None) if p is not None), None)


PEER_LOST_EXIT = 75  # a rank's exit code under megatron-rlhf launch when another rank vanished (it says which)
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank's process is gone (killed, crashed): gloo's
    read/write errors on the connection to it, not a fault of this rank."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_LOST)

