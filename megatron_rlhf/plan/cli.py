"""`megatron-rlhf plan CONFIG [key=value ...] [--json]`: will this layout fit, before a job is submitted.

    megatron-rlhf plan examples/llama3_70b_ppo.yaml --cluster examples/llama3_70b_slurm.yaml
    megatron-rlhf plan examples/llama3_8b_ppo.yaml --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --json

Prints, for each model, parameters per GPU and bytes per GPU (weights, gradients, optimizer,
activations, KV cache), the peak total against the GPU memory, "fits" or "does not fit", the largest
term and the smallest change that would fit. Exit code 0 when it fits, 1 when not, 2 for bad input.
The config is read as the stage reads it, but paths (data, tokenizer, checkpoints) need not exist yet.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.plan.planner import GIB, Cluster, Plan, plan_stage

STAGES = ("sft", "rm", "dpo", "ppo")


def load_for_plan(stage: str, yaml_path: Optional[str], overrides: Sequence[str]):
    """The stage's config (defaults <- YAML <- overrides, keys and types checked) without the checks of
    paths that exist only on the cluster; the architecture comes from model.hf_config / model.load when
    they exist here, from the inline model.* fields otherwise."""
    from megatron_rlhf.config import schema as C
    from megatron_rlhf.config import io as config_io

    cls = {"sft": C.SFTConfig, "rm": C.RMConfig, "dpo": C.DPOConfig, "ppo": C.PPOConfig}[stage]
    cfg, explicit = config_io.structured(cls, yaml_path, overrides)
    m = cfg.model
    if m.hf_config and not os.path.exists(m.hf_config):
        m.hf_config = None
    if m.load and not os.path.exists(m.load):
        m.load = None
    C.resolve_model(m, explicit)
    return cfg


def cluster_from_yaml(path: str) -> Cluster:
    """The cluster of a slurm/launch.py cluster YAML (nodes, ranks per node, memory of one device or CPU rank)."""
    from megatron_rlhf.config.cluster import load_cluster

    return Cluster.of(load_cluster(path, []))


def _gib(x: float, width: int = 7) -> str:
    """Bytes as GiB to one decimal; a phase that frees a few bytes shows 0.0, not -0.0."""
    return f"{round(x / GIB, 1) + 0.0:{width}.1f}"


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per model, then the phases, the total and the verdict."""
    unit = "GPU" if plan.device == "GPU" else "rank"
    lines = [f"plan: {plan.stage} on {plan.world} {plan.device}s (DP={plan.dp}), GiB per {plan.device}",
             f"{'model':<10} {'layout':<18} {'params/' + unit:>13} {'weights':>7} {'grads':>7} {'optim':>7} "
             f"{'activ.':>7} {'KV':>7}"]
    for m in plan.models:
        flag = "" if m.resident else f"  ({m.away})"
        lines.append(f"{m.name:<10} {m.layout:<18} {m.params_per_gpu:>13,} {_gib(m.weights)} {_gib(m.gradients)} "
                     f"{_gib(m.optimizer)} {_gib(m.activations)} {_gib(m.kv_cache + m.generation_weights)}{flag}")
    phases = ", ".join(f"{k} {_gib(v, 0)}" for k, v in plan.phases.items())
    lines.append(f"resident state {plan.state / GIB:.1f} GiB; phases (extra GiB): {phases}")
    name, size = plan.largest_term()
    verdict = "fits" if plan.fits else "does not fit"
    lines.append(f"{verdict}: peak {plan.total / GIB:.1f} GiB ({plan.peak_phase}) of {plan.gpu_bytes / GIB:.1f} GiB "
                 f"usable; largest term: {name} {size / GIB:.1f} GiB")
    if plan.suggestion:
        lines.append(f"smallest change that fits: {plan.suggestion}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-rlhf plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the stage's YAML config (a recipe)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for the stage")
    p.add_argument("--stage", choices=STAGES, default=None,
                   help="default: ppo or dpo when the YAML has that group, rm with a calibration group, else sft")
    p.add_argument("--cluster", help="slurm/launch.py cluster YAML (nodes, gpus_per_node, gpu_memory_gib)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--gpu-memory-gib", type=float)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_intermixed_args(list(argv))  # overrides may come after the flags


def guess_stage(yaml_path: str) -> str:
    from omegaconf import OmegaConf

    data = OmegaConf.load(yaml_path) if os.path.isfile(yaml_path) else {}
    return "ppo" if "ppo" in data else "dpo" if "dpo" in data else "rm" if "calibration" in data else "sft"


def cluster_of(args) -> Cluster:
    cluster = cluster_from_yaml(args.cluster) if args.cluster else Cluster()
    for key in ("nodes", "gpus_per_node", "gpu_memory_gib"):
        if getattr(args, key) is not None:
            setattr(cluster, key, getattr(args, key))
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise ConfigError(f"--nodes {cluster.nodes} and --gpus-per-node {cluster.gpus_per_node} must be >= 1 (a CPU "
                          "partition: pass --cluster with its YAML, whose ranks_per_node the planner counts)")
    return cluster


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    stage = args.stage or guess_stage(args.config)
    cfg = load_for_plan(stage, args.config, args.overrides)
    cluster = cluster_of(args)
    try:
        plan = plan_stage(cfg, stage, cluster)
    except ValueError as e:  # LayoutError, ConfigError: one line each
        if args.cluster or args.nodes or args.gpus_per_node:
            raise
        # A recipe's layout usually needs its own cluster: say which world size the refusal was for.
        raise type(e)(f"{e} (planned for the default {cluster.nodes} node x {cluster.gpus_per_node} GPUs: pass "
                      "--cluster CLUSTER.yaml, or --nodes and --gpus-per-node)") from None
    print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
    return 0 if plan.fits else 1
