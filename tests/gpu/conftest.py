import os

import pytest


@pytest.fixture
def world_of_one(monkeypatch):
    """Environment for a one-rank world (a free port unless torchrun set one); each test initialises the
    world itself (on NCCL or gloo, as it needs) and it is torn down afterwards."""
    from tests.distributed.launch import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, os.environ.get(k, v) if k != "MASTER_PORT" else v)
    yield
    from megatron_rlhf.parallel import init

    init.destroy()
