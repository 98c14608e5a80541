# Site-specific settings, sourced on every node by slurm/node.sh (and by slurm/train.sbatch).
# Edit this file for your cluster; slurm/launch.py's cluster YAML covers account, partition,
# nodes, GPUs, time, container and mounts.

# Python that has megatron_rlhf installed (inside the container when one is used).
export PYTHON=${PYTHON:-python}
# Rendezvous port on the first node (the same on every node).
export MASTER_PORT=${MASTER_PORT:-29500}
# Host threads per rank: the job's CPUs on this node / ranks per node (GPUS_PER_NODE), at least 1, at most 8.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  _cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
  _ranks=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  OMP_NUM_THREADS=$(( _cpus / (_ranks > 0 ? _ranks : 1) ))
  OMP_NUM_THREADS=$(( OMP_NUM_THREADS < 1 ? 1 : (OMP_NUM_THREADS > 8 ? 8 : OMP_NUM_THREADS) ))
  export OMP_NUM_THREADS
  unset _cpus _ranks
fi
# Megatron's tensor-parallel communication overlap needs ordered CUDA streams.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# NCCL: uncomment and adapt for your fabric (InfiniBand HCAs, socket interface).
# export NCCL_IB_HCA=mlx5
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_DEBUG=WARN
# Modules or a virtual environment, if the cluster uses them:
# module load cuda/12.8
# source /path/to/venv/bin/activate
