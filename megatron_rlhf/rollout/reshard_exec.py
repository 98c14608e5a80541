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
    receivers' shared-memory weights instead."""
    rank = dist.get_rank()
    src = dict(src_module.named_parameters())
    dst = dict(dst_module.named_parameters())
    local: Dict[int, torch.Tensor] = {}
    ops: List[dist.P2POp] = []
    for op in plan.send_ops:
        p = src.get(op.param_name)
        if p is None:
            continue
        view = p.data[op.my_slice]
        if op.peer_rank == rank:
            if op.task_id is None:
                raise RuntimeError(f"reshard plan: local send of {op.param_name} has no task id")
            local[op.task_id] = view
        elif exchange is None:
            ops.append(dist.P2POp(dist.isend, view.contiguous(), op.peer_rank, group=group))
    writebacks: List[Tuple[torch.Tensor, torch.Tensor]] = []
    copies: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, local source view)
    for op in plan.recv_ops:
        p = dst.get(op.param_name)
        if p is None:
            continue
        view = p.data[op.my_slice]
        if op.peer_rank == rank:
            if op.task_id not in local:
                raise RuntimeError(f"reshard plan: local receive of {op.param_name} (task {op.task_id}) has no send")
            copies.append((view, local.pop(op.task_id)))
            continue
        if exchange is not None:
            continue
        buffer = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype)
        ops.append(dist.P2POp(dist.irecv, buffer, op.peer_rank, group=group))
        if buffer is not view:
            writebacks.append((view, buffer))
    if local:
        raise RuntimeError(f"reshard plan: {len(local)} local sends without a receive on rank {rank}")
    if exchange is not None:
        exchange.begin()
        exchange.write(src)
    # Remote transfers first: gloo moves them on its own threads while this thread does the local copies.
    requests = dist.batch_isend_irecv(ops) if ops else []
    for view, source in copies:
        view.copy_(source)
    if exchange is not None:
        exchange.end()
    for request in requests:
        request.wait()
    for view, buffer in writebacks:
        view.copy_(buffer)
