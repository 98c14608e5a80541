#!/usr/bin/env bash
# The per-node part of a multi-node job: srun starts this once per node (--ntasks-per-node=1).
#   srun --ntasks-per-node=1 bash slurm/node.sh STAGE CONFIG.yaml [key=value ...]
# It starts `megatron-rlhf launch` with one rank per GPU (ranks SLURM_NODEID*G .. +G-1 of NODES*G),
# rendezvous on the first node of the allocation. Preemption: Slurm's SIGUSR1/SIGTERM reach the
# launcher, which forwards them to every rank (torchrun does not forward SIGUSR1); the ranks save a
# checkpoint at the end of the step and exit 0. After such a stop, node 0 requeues the job
# (`scontrol requeue`; needs --requeue) and the next run resumes from `latest`. A stop signal that
# arrives after the run has finished (rank 0 left no note in $STOPPED_FILE) requeues nothing.
# Rendezvous address: the first node's NodeAddr as Slurm itself uses it (node names need not resolve).
set -uo pipefail
# First thing: a stop signal is noted (and forwarded once the launcher runs), never this script's death.
STOP=0 LAUNCHER=
forward() { STOP=1; echo "node ${SLURM_NODEID:-0}: SIG$1 -> every rank saves a checkpoint and exits"; [ -z "$LAUNCHER" ] || kill -"$1" "$LAUNCHER" 2>/dev/null; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
cd "$(dirname "$0")/.."  # the checkout: relative paths (configs, slurm/env.sh) resolve from here
STAGE=${1:?usage: node.sh STAGE CONFIG [key=value ...]}
CONFIG=${2:?usage: node.sh STAGE CONFIG [key=value ...]}
shift 2
ENV_FILE=${ENV_FILE:-slurm/env.sh}
# shellcheck source=/dev/null
[ -f "$ENV_FILE" ] && source "$ENV_FILE"
PYTHON=${PYTHON:-python}
NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
NODE_RANK=${SLURM_NODEID:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
first_node_addr() {
  local first addr
  first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  addr=$(scontrol show node "$first" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)
  echo "${addr:-$first}"
}
MASTER_ADDR=${MASTER_ADDR:-$(first_node_addr)}
MASTER_PORT=${MASTER_PORT:-29500}
# Rank 0 writes "<unit> <n>" here when a stop signal ended the run early (trainer/run.py: save_or_stop).
export STOPPED_FILE=${TMPDIR:-/tmp}/megatron-rlhf-stopped-${SLURM_JOB_ID:-0}-$NODE_RANK-$$
rm -f "$STOPPED_FILE"
echo "node $NODE_RANK/$NODES ($(hostname)): $STAGE $CONFIG, $GPUS_PER_NODE ranks x ${OMP_NUM_THREADS:-?} threads," \
     "master $MASTER_ADDR:$MASTER_PORT, job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}"

# The launcher starts with the stop signals ignored (inherited), not at their default (exit 138), until its own
# handlers are in; it starts each rank with them blocked until the rank catches them (a stop during start-up
# is kept for the first step).
( trap '' USR1 TERM; exec "$PYTHON" -m megatron_rlhf.cli launch --nnodes "$NODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$STAGE" "$CONFIG" "$@" ) &
LAUNCHER=$!
# `wait` returns early when a trap runs: wait again until the launcher has really exited.
while :; do
  wait "$LAUNCHER"; rc=$?
  kill -0 "$LAUNCHER" 2>/dev/null || break
done
stopped=$(cat "$STOPPED_FILE" 2>/dev/null); rm -f "$STOPPED_FILE"
if [ "$STOP" = 1 ] && [ "$rc" = 0 ] && [ "$NODE_RANK" = 0 ] && [ -z "$stopped" ]; then
  echo "node 0: the stop signal came after the run had finished: nothing to resume"
elif [ -n "$stopped" ] && [ "$rc" = 0 ] && [ -n "${SLURM_JOB_ID:-}" ] && [ "${REQUEUE:-1}" = 1 ]; then
  echo "checkpoint saved at $stopped after a stop signal: requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
