"""`python slurm/launch.py STAGE CONFIG [key=value ...] --cluster CLUSTER.yaml [--dryrun]` (also
`megatron-rlhf submit ...`): a stage's Slurm job, checked by the planner first.

    python slurm/launch.py ppo examples/llama3_70b_ppo.yaml --cluster examples/llama3_70b_slurm.yaml --dryrun
    python slurm/launch.py ppo examples/llama3_70b_ppo.yaml --cluster ... --set nodes=32 --backend nemo-run
    python slurm/launch.py convert --cluster ... --hf-dir /data/llama3-70b-hf --out /data/llama3-70b-mcore

Training stages (sft, rm, dpo, ppo) are planned on the cluster's GPUs first; a layout the planner says does
not fit is refused unless --force. `--backend plain` fills slurm/train.sbatch in and submits it with
`sbatch`; `--backend nemo-run` builds a nemo-run `SlurmExecutor` (local or SSH tunnel). `--dryrun`
writes the complete sbatch script (to --out, or prints it) and submits nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Sequence

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.slurm import sbatch
from megatron_rlhf.config.cluster import load_cluster

STAGES = ("sft", "rm", "dpo", "ppo", "convert")


def _parse(argv: Sequence[str]):
    p = argparse.ArgumentParser(prog="slurm/launch.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--cluster", help="cluster YAML (account, partition, nodes, gpus_per_node, time, container...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a cluster key")
    p.add_argument("--backend", choices=("plain", "nemo-run"), default="plain")
    p.add_argument("--dryrun", action="store_true", help="write the sbatch script, submit nothing")
    p.add_argument("--out", help="with --dryrun: file for the script (default: print it)")
    p.add_argument("--force", action="store_true", help="submit even when the planner says it does not fit")
    args, rest = p.parse_known_args(list(argv))
    return args, rest


def check_plan(stage: str, config: str, overrides: Sequence[str], cluster, force: bool) -> None:
    """Print the plan; refuse (ConfigError) a layout that does not fit unless `force`."""
    from megatron_rlhf.plan.cli import format_plan, load_for_plan
    from megatron_rlhf.plan.planner import Cluster, plan_stage

    cfg = load_for_plan(stage, config, overrides)
    plan = plan_stage(cfg, stage, Cluster.of(cluster))
    print(format_plan(plan), file=sys.stderr)
    if not plan.fits and not force:
        name, size = plan.largest_term()
        raise ConfigError(
            f"the planner says {stage} does not fit: {plan.total / 2**30:.1f} GiB per {plan.device} of "
            f"{plan.gpu_bytes / 2**30:.1f} GiB usable (largest: {name}); try {plan.suggestion}, or pass --force")


def node_cpus(partition) -> list:
    """CPUs of each node of `partition` (None: the default one) as `sinfo` reports them; [] without a Slurm here."""
    cmd = ["sinfo", "-h", "-N", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(c) for c in out.stdout.split() if c.isdigit()] if out.returncode == 0 else []


def fit_cpus(cluster) -> None:
    """cpus_per_task against the partition's nodes: a request larger than every node is accepted by Slurm and
    then pends forever (Reason=PartitionConfig), so it is an error here; unset, it becomes a node's CPUs."""
    cpus = node_cpus(cluster.partition)
    if not cpus:
        return  # no sinfo (a dry run elsewhere): the script keeps what the YAML says
    where = f"partition '{cluster.partition}'" if cluster.partition else "the default partition"
    if cluster.cpus_per_task is None:
        cluster.cpus_per_task = min(cpus)
    elif cluster.cpus_per_task > max(cpus):
        raise ConfigError(f"cpus_per_task={cluster.cpus_per_task} but the nodes of {where} have at most {max(cpus)} "
                          f"CPUs (sinfo): set cpus_per_task={max(cpus)}, or null for all CPUs of a node")


def main(argv: Sequence[str]) -> int:
    args, rest = _parse(argv)
    cluster = load_cluster(args.cluster, args.set)
    if cluster.tunnel == "local":
        fit_cpus(cluster)
    if args.stage == "convert":
        config, overrides = "", rest
    else:
        if not rest or "=" in rest[0]:
            raise ConfigError(f"{args.stage}: give the stage's YAML config after the stage name")
        config, overrides = rest[0], rest[1:]
        check_plan(args.stage, config, overrides, cluster, args.force)
    source = " ".join([args.stage, config, *overrides]).strip()
    if args.backend == "nemo-run":
        from megatron_rlhf.slurm import nemo

        if not args.dryrun:
            nemo.submit(args.stage, config, overrides, cluster)
            return 0
        with tempfile.TemporaryDirectory() as home:
            script = nemo.render(args.stage, config, overrides, cluster, home)
    else:
        if cluster.tunnel == "ssh":
            raise ConfigError("tunnel=ssh needs --backend nemo-run (the plain backend runs sbatch on this machine)")
        script = sbatch.render(args.stage, config, overrides, cluster, source)
    if args.dryrun:
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(script)
            print(f"wrote {args.out} (not submitted)", file=sys.stderr)
        else:
            print(script, end="")
        return 0
    os.makedirs(cluster.log_dir, exist_ok=True)
    path = os.path.join(cluster.log_dir, f"{cluster.job_name}-{args.stage}.sbatch")
    with open(path, "w") as fh:
        fh.write(script)
    return subprocess.call(["sbatch", path])
