"""Same-host transport for a reshard plan on CPU: senders write straight into the receivers' weights.

On one host, gloo P2P moves bytes over loopback TCP at about 0.3x the speed of a plain copy (1 MiB messages;
docs/hybrid.md). Here each rank's generation copy of the policy keeps its parameters in one shared-memory
segment (a file in /dev/shm that every rank maps and that is unlinked at once, so nothing is left behind even
after kill -9), and a swap is:

1. barrier (no rank is still generating with the weights about to change);
2. each rank copies every slice it sends straight into the receiving rank's parameter, and its local
   slices into its own: one copy per byte;
3. barrier (every weight is in place before anyone generates).

Pairing: between two ranks, the k-th send of the sender's plan meets the k-th receive of the receiver's plan
(the order gloo P2P relies on too); receivers publish their receive slices once, when the exchange is built.
The GPU path keeps megatron's NCCL executor. `build` returns None, and gloo P2P stays, when the ranks are on
several hosts or /dev/shm lacks room for the generation weights (a mapping past its free space would die of
SIGBUS at first touch).
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: every parameter starts aligned for any dtype
HEADROOM = 1.25  # /dev/shm must hold the segment with this margin


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _room_for(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return os.access(SHM_DIR, os.W_OK) and st.f_bavail * st.f_frsize >= nbytes * HEADROOM


def _segment(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _view(segment: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return segment[offset : offset + n].view(dtype).view(shape)


class SharedMemoryExchange:
    """The remote part of one reshard plan through the receivers' shared weights (module docstring)."""

    def __init__(self, writes: List[Tuple[str, tuple, torch.Tensor]], group, segments: List[torch.Tensor]):
        self.writes = writes  # (source param name, source slice, destination view in a peer's segment), plan order
        self.group = group
        self.segments = segments  # keep the peers' mappings alive

    @classmethod
    def build(cls, plan, src_module: torch.nn.Module, dst_module: torch.nn.Module, group) -> Optional["SharedMemoryExchange"]:
        """Collective over the world. Moves `dst_module`'s parameters into a shared segment (values kept) and
        returns the exchange for `plan`; None when the ranks are on several hosts or /dev/shm is too small."""
        rank, world = dist.get_rank(), dist.get_world_size()
        src, dst = dict(src_module.named_parameters()), dict(dst_module.named_parameters())
        layout: Dict[str, Tuple[int, torch.dtype, tuple]] = {}
        total = 0
        for name, p in dst.items():
            layout[name] = (total, p.dtype, tuple(p.shape))
            total += _aligned(_nbytes(p))
        receives: Dict[int, List[Tuple[str, tuple]]] = {}
        for op in plan.recv_ops:
            if op.param_name in dst and op.peer_rank != rank:
                receives.setdefault(op.peer_rank, []).append((op.param_name, op.my_slice))
        ok = total > 0 and _room_for(total)
        path = os.path.join(SHM_DIR, f"megatron_rlhf_weights_{uuid.uuid4().hex}_{rank}") if ok else None
        if path is not None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)
            finally:
                os.close(fd)
        info: List[Optional[tuple]] = [None] * world
        dist.all_gather_object(info, (socket.gethostname(), path, total, layout, receives), group=group)
        usable = all(i[0] == info[0][0] and i[1] is not None for i in info)
        segments: Dict[int, torch.Tensor] = {}
        try:
            if usable:
                targets = {op.peer_rank for op in plan.send_ops if op.param_name in src and op.peer_rank != rank}
                for r in targets | {rank}:
                    segments[r] = _segment(info[r][1], info[r][2])
            dist.barrier(group=group)  # every rank has mapped what it needs: the names can go
        finally:
            if path is not None:
                os.unlink(path)
        if not usable:
            return None
        own = segments[rank]
        with torch.no_grad():
            for name, p in dst.items():  # this rank's generation weights now live in its segment
                offset, dtype, shape = layout[name]
                view = _view(own, offset, dtype, shape)
                view.copy_(p.data)
                p.data = view
        writes, taken = [], {}
        for op in plan.send_ops:
            if op.param_name not in src or op.peer_rank == rank:
                continue
            peer = op.peer_rank
            k = taken.get(peer, 0)
            taken[peer] = k + 1
            name, where = info[peer][4][rank][k]
            offset, dtype, shape = info[peer][3][name]
            writes.append((op.param_name, op.my_slice, _view(segments[peer], offset, dtype, shape)[where]))
        for peer in set(taken) | {r for r, i in enumerate(info) if rank in i[4]}:
            k = taken.get(peer, 0)
            if k != len(info[peer][4].get(rank, [])):
                raise RuntimeError(f"reshard plan: {k} sends to rank {peer}, which expects "
                                   f"{len(info[peer][4].get(rank, []))} from rank {rank}")
        return cls(writes, group, list(segments.values()))

    def begin(self) -> None:
        """Step 1: wait until no rank still uses the weights about to change."""
        dist.barrier(group=self.group)

    def write(self, src: Dict[str, torch.Tensor]) -> None:
        """Step 2 (remote part): this rank's sends, straight into the receivers' parameters."""
        for name, where, destination in self.writes:
            destination.copy_(src[name].data[where])

    def end(self) -> None:
        """Step 3: every weight is in place."""
        dist.barrier(group=self.group)
