"""Execute a megatron-core reshard plan on CPU (gloo) with one copy per byte instead of three.

megatron-core 0.16.1's `execute_reshard_plan` + `GlooCopyService` receive every slice into a fresh buffer,
copy it into a second fresh buffer, then copy that into the parameter: three copies and two new
allocations (whose pages fault in on first touch) per received byte. Here a slice is received straight
into the destination parameter when its view is contiguous (rows of a TP split: most bytes), into one
buffer otherwise (columns), and local slices are copied once, while the remote ones are in flight. Same plan, same pairing (remote ops
posted in plan order, as megatron's service posts them; local ones matched by task id), same result:
tests/distributed/test_hybrid.py checks the weights to the bit after swaps between TP, PP and VPP layouts.

On one host WeightSwap also passes a `SharedMemoryExchange` (rollout/shm_exchange.py): the remote slices are
then written straight into the receivers' shared-memory weights, and no gloo P2P op runs. On GPU WeightSwap
keeps megatron's executor with its NCCL service.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist


@torch.no_grad()
def execute_plan_gloo(plan, src_module: torch.nn.Module, dst_module: torch.nn.Module, group, exchange=None) -> None:
    """`plan` (megatron.core.resharding.ReshardPlan) for this rank: copy `src_module`'s slices into
    `dst_module`'s parameters over `group` (gloo, the whole world; CPU tensors). With `exchange`
    (rollout/shm_exchange.py, built for this plan) the remote slices are written straight into the
    receivers' shared-memory weights instead of travelling as gloo P2P ops."""
    src = dict(src_module.named_parameters())
    dst = dict(dst_module.named_parameters())
    copies = _local_copies(plan, src, dst)
    if exchange is not None:
        exchange.begin()
        exchange.write(src)
        for view, source in copies:
            view.copy_(source)
        exchange.end()
        return
    ops, writebacks = _remote_ops(plan, src, dst, group)
    # Remote transfers first: gloo moves them on its own threads while this thread does the local copies.
    requests = dist.batch_isend_irecv(ops) if ops else []
    for view, source in copies:
        view.copy_(source)
    for request in requests:
        request.wait()
    for view, buffer in writebacks:
        view.copy_(buffer)


def _local_copies(plan, src: Dict[str, torch.Tensor], dst: Dict[str, torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) for the slices this rank sends to itself, matched by task id."""
    rank = dist.get_rank()
    local: Dict[int, torch.Tensor] = {}
    for op in plan.send_ops:
        if op.peer_rank == rank and op.param_name in src:
            if op.task_id is None:
                raise RuntimeError(f"reshard plan: local send of {op.param_name} has no task id")
            local[op.task_id] = src[op.param_name].data[op.my_slice]
    copies = []
    for op in plan.recv_ops:
        if op.peer_rank == rank and op.param_name in dst:
            if op.task_id not in local:
                raise RuntimeError(f"reshard plan: local receive of {op.param_name} (task {op.task_id}) has no send")
            copies.append((dst[op.param_name].data[op.my_slice], local.pop(op.task_id)))
    if local:
        raise RuntimeError(f"reshard plan: {len(local)} local sends without a receive on rank {rank}")
    return copies


def _remote_ops(plan, src: Dict[str, torch.Tensor], dst: Dict[str, torch.Tensor], group):
    """gloo P2P ops for the slices exchanged with other ranks, in plan order (the pairing megatron's service
    relies on), and the (destination view, buffer) pairs to write back after them. A slice is received
    straight into the parameter when its view is contiguous, into a buffer otherwise."""
    rank = dist.get_rank()
    ops: List[dist.P2POp] = []
    for op in plan.send_ops:
        if op.peer_rank != rank and op.param_name in src:
            ops.append(dist.P2POp(dist.isend, src[op.param_name].data[op.my_slice].contiguous(), op.peer_rank,
                                  group=group))
    writebacks: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for op in plan.recv_ops:
        if op.peer_rank != rank and op.param_name in dst:
            view = dst[op.param_name].data[op.my_slice]
            buffer = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype)
            ops.append(dist.P2POp(dist.irecv, buffer, op.peer_rank, group=group))
            if buffer is not view:
                writebacks.append((view, buffer))
    return ops, writebacks
