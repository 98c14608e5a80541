import gc
import os

import pytest
import torch


@pytest.fixture(scope="module")
def world():
    """A world of one (gloo) with Megatron's parallel state; torn down only if we started it."""
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from tests.distributed.launch import free_port

    started = not torch.distributed.is_initialized()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    init.initialize(ParallelConfig(), seed=1234)
    yield
    from megatron_rlhf.parallel import watchdog

    watchdog.stop()  # started by initialize: its thread and the store it holds end with the module
    init.destroy_model_parallel()
    if started:
        torch.distributed.destroy_process_group()
    # The module's models hold their groups in reference cycles (hooks): collected now, their gloo threads end
    # while the interpreter is whole, not during its shutdown.
    gc.collect()
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
