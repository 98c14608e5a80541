"""torch.distributed + Megatron `parallel_state` initialisation from torchrun or Slurm environments.

One SPMD program: every rank calls `initialize(parallel, ...)` with the same validated layout.
Backend is nccl with CUDA and gloo without; the CPU layer (`parallel/cpu.py`) is switched on
when CUDA is absent.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megatron_rlhf.parallel import cpu, lifetime, watchdog
from megatron_rlhf.parallel.layout import LayoutError, ParallelConfig


class RendezvousError(LayoutError):
    """The rendezvous address does not resolve: one line naming it (a LayoutError, so the CLI prints one line)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def dist_env(environ: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Rank layout from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or srun (SLURM_PROCID/NTASKS/LOCALID).

    torchrun's variables win when both are present (torchrun inside an srun allocation). A plain
    `python script.py` is a world of one.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", 29500))
    return DistEnv(rank, world, local, addr, port)


def world_size_from_env() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return dist_env().world_size


def check_rendezvous_host(addr: str, port: int) -> None:
    """Resolve MASTER_ADDR before c10d does: c10d retries an unresolvable name for its whole timeout (600 s,
    "The IPv6 network addresses of (n1, 29500) cannot be retrieved"); this fails at once, naming it."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise RendezvousError(
            f"rendezvous host MASTER_ADDR={addr} does not resolve ({getattr(e, 'strerror', e)}): set MASTER_ADDR to "
            "the first node's address (slurm/node.sh uses its NodeAddr from `scontrol show node`)") from None


def init_process_group(timeout_s: int = 600) -> DistEnv:
    """Start torch.distributed (once): with CUDA, NCCL for tensors on the GPU and gloo for those on the
    host (step statistics, token counts, rollout rows), so that a collective works on either; gloo on CPU."""
    cpu.enable()
    lifetime.follow_launcher()  # a dying launcher means: checkpoint and exit
    lifetime.keep_checkpoint_results_in_process()  # no checkpoint manager process at all
    lifetime.forked_children_die_with_rank()  # nor a forked checkpoint writer (nor the tracker it holds open)
    env = dist_env()
    if torch.distributed.is_initialized():
        return env
    check_rendezvous_host(env.master_addr, env.master_port)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    torch.distributed.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return env


def initialize(parallel: ParallelConfig, seed: int = 1234) -> DistEnv:
    """Process group, Megatron model-parallel groups and RNG seeds for a validated layout.

    Call `layout.validate_layout` before this so a bad layout fails before any work.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    env = init_process_group(timeout_s=parallel.timeout_s + 60)  # the watchdog's line comes before gloo's timeout
    watchdog.start(parallel.timeout_s)
    destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return env


# What still references process groups after megatron-core 0.16.1's destroy_model_parallel: two globals it leaves
# set (aliases of the data-parallel-with-CP groups), and the lru_cache on the rotary embeddings' `forward`, whose
# keys are the modules themselves (each holding its cp_group).
_MEGATRON_LEFTOVERS = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")
_MEGATRON_CACHED_FORWARDS = (("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
                             ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"))


def destroy_model_parallel() -> None:
    """Megatron's `destroy_model_parallel`, and what it leaves referencing the groups: kept, they keep their gloo
    threads and the job's TCP store (and its server thread) alive into interpreter shutdown, where a live
    process group can end the process in std::terminate (exit 134) after its work is done."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name in _MEGATRON_LEFTOVERS:
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    for module, cls in _MEGATRON_CACHED_FORWARDS:
        forward = getattr(getattr(sys.modules.get(module), cls, None), "forward", None)
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()


def destroy() -> None:
    watchdog.stop()
    destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
