#!/usr/bin/env bash
# A Slurm cluster of N nodes on this host, for trying the Slurm path without a cluster (and for tests/slurm/).
#   slurm/local_cluster.sh up [N]    # munged + slurmctld + N slurmd (nodes n1..nN), waits until all are idle
#   export SLURM_CONF=/tmp/megatron-rlhf-slurm/slurm.conf   # `up` prints this line; sbatch passes it on to jobs
#   slurm/local_cluster.sh down      # cancels the jobs, stops every daemon by its PID, removes nothing else
# Needs root and Debian's `slurmctld slurmd slurm-client munge` (no systemd, no cgroups): the daemons run as
# root, listen on 127.0.0.1 only and keep everything (state, spool, logs, pids, munge key) in CLUSTER_DIR.
# Node names n1..nN do not resolve (NodeHostname is this host, NodeAddr 127.0.0.1): jobs must use the
# address Slurm uses, as on clusters whose node names are not host names. /etc/hosts is never touched.
# Settings (environment): CLUSTER_DIR (default /tmp/megatron-rlhf-slurm), SLURMCTLD_PORT (16817),
# SLURMD_PORT (17001: nodes use SLURMD_PORT .. SLURMD_PORT+N-1), NODE_CPUS (this host's CPUs).
set -euo pipefail

DIR=${CLUSTER_DIR:-/tmp/megatron-rlhf-slurm}
CTLD_PORT=${SLURMCTLD_PORT:-16817}
NODE_PORT=${SLURMD_PORT:-17001}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

# Start a daemon in the foreground mode of its own, detached from our terminal and pipes; record its PID.
start() {  # name, command...
  local name=$1; shift
  setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo $! >"$DIR/pids/$name"
}

wait_until() {  # seconds, what, command...: poll the command until it succeeds
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "$what within $limit s (logs: $DIR/log)"
    sleep 0.2
  done
}

all_idle() {  # every node of the cluster idle
  local states
  states=$(sinfo -h -N -o '%T' 2>/dev/null) || return 1
  [ "$(grep -c '^idle$' <<<"$states")" = "$1" ]
}

up() {
  local n=${1:-2}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a number of nodes >= 1 (got '$n')"
  [ "$(id -u)" = 0 ] || die "needs root (the daemons run as SlurmUser=root)"
  for bin in munged mungekey slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || die "$bin is missing: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
  done
  [ ! -s "$DIR/pids/slurmctld" ] || ! kill -0 "$(cat "$DIR/pids/slurmctld")" 2>/dev/null \
    || die "a cluster is already up in $DIR: slurm/local_cluster.sh down first"
  local cpus=${NODE_CPUS:-$(nproc)} last=$((NODE_PORT + n - 1)) port
  for port in "$CTLD_PORT" $(seq "$NODE_PORT" "$last"); do
    ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || die "port $port is in use: set SLURMCTLD_PORT / SLURMD_PORT"
  done
  if [ -e "$DIR" ] && [ -n "$(ls -A "$DIR")" ] && ! grep -qs '^# Written by slurm/local_cluster.sh' "$CONF"; then
    die "$DIR is not empty and holds no cluster of ours: set CLUSTER_DIR to a new directory"
  fi
  rm -rf "$DIR"  # an earlier cluster's state: every up starts clean
  mkdir -p "$DIR"/{munge,state,log,pids,run}
  chmod 755 "$DIR" "$DIR/munge"  # munged refuses a socket directory others can write to
  for i in $(seq 1 "$n"); do mkdir -p "$DIR/spool/n$i"; done  # SlurmdSpoolDir=%n must exist first

  mungekey -c -k "$DIR/munge/munge.key"
  start munged munged -F --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
  wait_until 10 "munged did not open its socket" test -S "$DIR/munge/munge.socket"

  cat >"$CONF" <<EOF
# Written by slurm/local_cluster.sh: $n nodes on $(hostname), everything under $DIR.
ClusterName=local
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5: a requeued job may start again after ~7 s (the default, 120 s, holds it 2 minutes)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# finished jobs stay in scontrol for an hour (there is no accounting database for sacct)
MinJobAge=3600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=n[1-$n] NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=[$NODE_PORT-$last] CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

  start slurmctld slurmctld -D -i -f "$CONF"
  for i in $(seq 1 "$n"); do start "slurmd-n$i" slurmd -D -N "n$i" -f "$CONF"; done
  wait_until 60 "not all $n nodes became idle" all_idle "$n"
  echo "export SLURM_CONF=$CONF"
}

down() {
  [ -d "$DIR/pids" ] || { echo "no cluster in $DIR"; return 0; }
  if [ -s "$DIR/pids/slurmctld" ] && kill -0 "$(cat "$DIR/pids/slurmctld")" 2>/dev/null; then
    # Jobs first: a job's processes belong to slurmstepd, which outlives its slurmd.
    scancel --quiet --user=root 2>/dev/null || true
    local deadline=$((SECONDS + 60))
    while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  fi
  local name pid pids=()
  for name in $(ls "$DIR/pids" | grep '^slurmd-') slurmctld munged; do  # munged last: the others use it
    [ -s "$DIR/pids/$name" ] || continue
    pid=$(cat "$DIR/pids/$name")
    if kill -TERM "$pid" 2>/dev/null; then pids+=("$pid"); fi
    rm -f "$DIR/pids/$name"
  done
  local deadline=$((SECONDS + 30))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  # A job that would not end outlives its slurmd in slurmstepd: kill those of this cluster with their tasks.
  for pid in $(leftover_steps); do
    kill -KILL $(descendants "$pid") "$pid" 2>/dev/null || true
  done
  echo "local cluster in $DIR stopped"
}

leftover_steps() {  # slurmstepd processes started by this cluster's slurmd (their environment names $CONF)
  local p
  for p in $(pgrep -f '^slurmstepd' 2>/dev/null); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_CONF=$CONF" && echo "$p"
  done
  return 0
}

descendants() {  # every process below PID $1
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do descendants "$c"; echo "$c"; done
}

case "${1:-}" in
  up) up "${2:-${NODES:-2}}" ;;
  down) down ;;
  *) die "usage: slurm/local_cluster.sh up [N] | down   (CLUSTER_DIR=$DIR)" ;;
esac
