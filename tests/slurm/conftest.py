"""Fixtures of the real-Slurm tests: one local cluster (2 nodes on this host) for the whole package, torn down
by PID when the package is done, also after a failure; every job is cancelled when its test ends.

Without root or Slurm's binaries every test here skips with one line saying what it needs."""

import os

import pytest

from tests.distributed.conftest import data  # noqa: F401 - the tiny SFT/preference data, shared
from tests.slurm.cluster import Cluster, missing_requirement
from tests.slurm.stages import LONG_STEPS, rm_config, run_local, sft_config


def pytest_runtest_setup(item):
    """Skip here, not in a fixture: raised from one place, the skips fold into one line of `pytest -rs`."""
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="package")
def slurm(tmp_path_factory):
    """A running 2-node cluster; SLURM_CONF points at it while the package runs."""
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.conf
    try:
        cluster.up()
        yield cluster
    finally:
        left = cluster.down()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        assert not left, f"the local cluster left these behind: {left}"


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """After each test that used the cluster: cancel what is left of its jobs and wait until they are gone."""
    yield
    if "slurm" in request.fixturenames:
        request.getfixturevalue("slurm").cancel_all()


@pytest.fixture(scope="package")
def tiny(slurm, data, tmp_path_factory):
    """Local references (`megatron-rlhf launch --nproc-per-node 2`): the tiny SFT (6 steps; also the PPO
    policy), an RM (4 steps) for PPO, and a longer SFT that a stop signal can reach mid-run."""
    tmp = tmp_path_factory.mktemp("tiny_local")
    refs = {"data": data, "sft": sft_config(data, tmp, "sft"),
            "rm": rm_config(data, tmp, "rm", **{"train.train_steps": 4}),
            "long": sft_config(data, tmp, "long", **{"train.train_steps": LONG_STEPS})}
    for stage, name in (("sft", "sft"), ("rm", "rm"), ("sft", "long")):
        run_local(stage, refs[name])
    return refs
