"""Rank layout from torchrun and from srun environments."""

from megatron_rlhf.parallel.init import dist_env


def test_torchrun_environment():
    env = dist_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (5, 8, 1, "node0", 1234)


def test_slurm_environment():
    env = dist_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "MASTER_ADDR": "n3"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (9, 16, 1, "n3")


def test_torchrun_inside_slurm_wins():
    env = dist_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size) == (1, 2)


def test_plain_python_is_a_world_of_one():
    env = dist_env({})
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
