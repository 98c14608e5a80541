"""Memory and layout plan of a stage on a cluster: does it fit, what dominates, what would make it fit.

    plan = plan_stage(cfg, "ppo", Cluster(nodes=16, gpus_per_node=8, gpu_memory_gib=80))

PPO has four models (ppo-spec.md), each counted with its own architecture (config/stage_models.py: a 70B policy
beside an 8B reward model and critic): policy and value train in the training layout (parallel.*); the
frozen reference and reward models run in the inference layout (TP=ppo.inference_tp, PP=1; the reward model's
ppo.reward_inference_tp) when that key is set (the hybrid-engine issue), in the training layout otherwise; the policy generates in the
generation layout (TP=rollout.tp, PP=1, DP=world/rollout.tp; the training TP when unset).

Peak bytes per GPU = resident state (weights, gradients, optimizer of every model on the GPU) + the
largest of the phases' extra needs: `train_policy`/`train_value` (activations), `rollout` (KV cache
and, when the generation layout differs or vLLM generates, the policy's copy there, minus what waits in
host memory meanwhile: both trained models' gradients and optimizer state, and with
`rollout.release_training_weights` the policy's training weights; so it may be negative) and `score` (the
frozen models' forward, and their weights when `ppo.offload_frozen` keeps them in host memory between
uses). `ppo.reference_mode=swap` puts no reference weights on the GPU.

DPO has two: the policy trains in the training layout on chosen and rejected rows together, beside its
frozen reference in the same layout (`_plan_dpo`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_rlhf.config.stage_models import check_ppo_stage, other_models, reward_inference_tp
from megatron_rlhf.parallel.layout import LayoutError, validate_layout
from megatron_rlhf.plan.memory import (Activations, ModelMemory, activation_bytes, dtype_bytes, inference_bytes,
                                       kv_cache_bytes, model_memory)
from megatron_rlhf.plan.params import Layout, params_per_gpu
from megatron_rlhf.config.rollout import generation_tp

GIB = 1024**3


@dataclass
class Cluster:
    """Where the job runs (from the Slurm YAML of slurm/launch.py, or `plan` flags)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    cpu: bool = False  # a CPU partition: gpus_per_node counts ranks, gpu_memory_gib is one rank's memory

    # A CPU rank has no CUDA context or NCCL buffers; what it holds besides the plan's terms is the interpreter
    # with torch, Megatron and transformers imported (about 0.5 GiB resident) and gloo's buffers.
    CPU_RESERVE_GIB = 1.0

    @classmethod
    def of(cls, slurm) -> "Cluster":
        """The planner's view of a slurm/launch.py cluster (config/cluster.py SlurmCluster): one device per
        rank, so a CPU partition (gpus_per_node 0, ranks_per_node N) plans N ranks per node."""
        cpu = slurm.gpus_per_node == 0
        return cls(nodes=slurm.nodes, gpus_per_node=slurm.ranks, gpu_memory_gib=slurm.gpu_memory_gib,
                   reserve_gib=cls.CPU_RESERVE_GIB if cpu else cls.reserve_gib, cpu=cpu)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Plan:
    stage: str
    world: int
    dp: int
    models: List[ModelMemory]
    phases: Dict[str, float]  # extra bytes per GPU of each phase on top of the resident state
    gpu_bytes: float  # usable: GPU memory minus the reserve
    suggestion: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    device: str = "GPU"  # what one rank's memory is: "GPU", or "CPU rank" on a CPU partition

    @property
    def state(self) -> float:
        return sum(m.state for m in self.models if m.resident)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def total(self) -> float:
        return self.state + max(self.phases.values(), default=0.0)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def largest_term(self) -> tuple[str, float]:
        """(description, bytes) of the biggest single term in the peak total."""
        terms = {}
        for m in self.models:
            if m.resident:
                for key in ("weights", "gradients", "optimizer"):
                    terms[f"{m.name} {key}"] = getattr(m, key)
        terms[f"{self.peak_phase} phase ({_phase_what(self.peak_phase)})"] = self.phases[self.peak_phase]
        name = max(terms, key=terms.get)
        return name, terms[name]

    def to_dict(self) -> dict:
        name, size = self.largest_term()
        return {"stage": self.stage, "world": self.world, "dp": self.dp, "device": self.device, "fits": self.fits,
                "total_bytes_per_gpu": self.total, "state_bytes_per_gpu": self.state,
                "gpu_bytes": self.gpu_bytes, "peak_phase": self.peak_phase, "phases": self.phases,
                "largest_term": {"name": name, "bytes": size}, "suggestion": self.suggestion,
                "models": {m.name: m.to_dict() for m in self.models}, "notes": self.notes}


def _phase_what(phase: str) -> str:
    return {"train_policy": "activations", "train_value": "activations", "train": "activations",
            "rollout": "KV cache + generation weights", "score": "frozen forward",
            "reference_logprobs": "reference forward",
            "eval": "KV cache, and the reference reloaded after precompute"}.get(phase, phase)


def check_layouts(cfg, stage: str, world: int) -> None:
    """Every divisibility the stage needs (LayoutError / ConfigError, one line each)."""
    from megatron_rlhf.config.schema import check_batch_layout

    m, p = cfg.model, cfg.parallel
    validate_layout(p, world, num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                    num_query_groups=m.num_query_groups, cuda_available=True, te_available=True)
    dp = p.dp(world)
    if stage != "ppo":
        check_batch_layout(cfg.train, dp)
        if stage == "dpo":
            from megatron_rlhf.config.dpo import check_dpo_layout

            check_dpo_layout(cfg)
        return

    check_ppo_stage(cfg, dp)  # the PPO stage's own check at start: the plan accepts what the run accepts


def plan_stage(cfg, stage: str, cluster: Cluster, suggest: bool = True) -> Plan:
    """The plan of `stage` (sft | rm | dpo | ppo) for the resolved config `cfg` on `cluster`."""
    world = cluster.world
    check_layouts(cfg, stage, world)
    p, t = cfg.parallel, cfg.train
    policy_arch = cfg.model.to_model_config()
    dp = p.dp(world)
    train_layout = Layout(p.tp, p.pp, p.vpp)
    fp8 = cfg.fp8.format is not None
    trained_kw = dict(trained=True, dp=dp, distributed_optimizer=p.use_distributed_optimizer, fp8=fp8)
    frozen_kw = dict(trained=False, dp=dp, distributed_optimizer=False, fp8=False)
    act = lambda micro, seq, nmb: Activations(  # noqa: E731
        micro_batch=micro, seq_len=seq, num_microbatches=nmb, cp=p.cp, sequence_parallel=p.sequence_parallel,
        recompute=p.recompute, flash=fp8)
    notes = []
    if cluster.cpu:
        notes.append(f"a CPU partition: each rank is planned with gpu_memory_gib ({cluster.gpu_memory_gib:g} GiB, "
                     "its share of the node's memory); moves to host memory free nothing there")
    if not fp8:
        notes.append("activations assume unfused attention (no FP8/Transformer Engine): a conservative estimate")
    if stage in ("sft", "rm"):
        head = "lm" if stage == "sft" else "scalar"
        model = model_memory("policy" if stage == "sft" else "reward", policy_arch, train_layout, head, **trained_kw)
        micro = t.micro_batch_size * (2 if stage == "rm" else 1)  # RM: chosen and rejected in one batch
        nmb = t.global_batch_size // (t.micro_batch_size * dp)
        model.activations = activation_bytes(policy_arch, train_layout, act(micro, cfg.data.max_seq_len, nmb), head)
        plan = Plan(stage, world, dp, [model], {"train": model.activations}, _usable(cluster), notes=notes)
    elif stage == "dpo":
        plan = _plan_dpo(cfg, cluster, policy_arch, train_layout, trained_kw, frozen_kw, act, notes)
    else:
        plan = _plan_ppo(cfg, cluster, policy_arch, train_layout, trained_kw, frozen_kw, act, notes)
    plan.device = "CPU rank" if cluster.cpu else "GPU"
    if suggest and not plan.fits:
        plan.suggestion = suggest_change(cfg, stage, cluster)
    return plan


def _usable(cluster: Cluster) -> float:
    return (cluster.gpu_memory_gib - cluster.reserve_gib) * GIB


def _plan_ppo(cfg, cluster, policy_arch, train_layout, trained_kw, frozen_kw, act, notes) -> Plan:
    p, t, ppo, world = cfg.parallel, cfg.train, cfg.ppo, cluster.world
    dp = p.dp(world)
    seq = (cfg.data.max_prompt_len or cfg.data.max_seq_len) + ppo.max_new_tokens
    arch = {m.name: m.arch for m in other_models(cfg)}  # each model's own (config/stage_models.py)
    value_arch, reward_arch = arch.get("value", policy_arch), arch["reward"]
    reference_arch = arch.get("reference", policy_arch)  # ppo.reference_mode=swap: the policy's own model
    inf_tp = ppo.inference_tp
    inf_layout = train_layout if inf_tp is None else Layout(inf_tp, 1)
    reward_tp = reward_inference_tp(ppo)
    reward_layout = train_layout if reward_tp is None else Layout(reward_tp, 1)
    policy = model_memory("policy", policy_arch, train_layout, "lm", **trained_kw)
    value = model_memory("value", value_arch, train_layout, "scalar", **trained_kw)
    swap_reference = ppo.reference_mode == "swap"
    # ppo.reference_mode=swap: no reference model on the GPU; the policy's chunks run its forward (training layout)
    ref_layout = train_layout if swap_reference else inf_layout
    reference = model_memory("reference", reference_arch, ref_layout, "lm", **frozen_kw)
    reward = model_memory("reward", reward_arch, reward_layout, "scalar", **frozen_kw)
    nmb = ppo.minibatch_size // (dp * t.micro_batch_size)
    policy.activations = activation_bytes(policy_arch, train_layout, act(t.micro_batch_size, seq, nmb), "lm")
    value.activations = activation_bytes(value_arch, train_layout, act(t.micro_batch_size, seq, nmb), "scalar")
    reference.activations = inference_bytes(reference_arch, ref_layout, t.micro_batch_size, seq, "lm")
    reward.activations = inference_bytes(reward_arch, reward_layout, t.micro_batch_size, seq, "scalar")
    gen_tp = generation_tp(cfg)
    gen_layout = Layout(gen_tp, 1)
    gen_dp = world // gen_tp
    policy.kv_cache = kv_cache_bytes(policy_arch, gen_tp, -(-ppo.rollout_batch_size // gen_dp), seq)  # ceil: redistribute.py
    # sequence parallelism: a decode step cannot split its one token, so generation gets its own copy (rollout/layout.py)
    own_layout = gen_layout != Layout(p.tp, p.pp, p.vpp) or p.sequence_parallel
    copy_generates = own_layout or cfg.rollout.engine == "vllm"
    if copy_generates:
        policy.generation_weights = params_per_gpu(policy_arch, gen_layout) * dtype_bytes(policy_arch.params_dtype)
    # On a CPU partition host memory is the rank's memory: the moves to it (rollout/offload.py, frozen
    # offload, reference swap) free nothing, so everything counts as resident.
    offload = ppo.offload_frozen and not cluster.cpu
    reward.resident = not offload
    reference.resident = not (offload or swap_reference)
    if swap_reference:
        if cluster.cpu:
            reference.resident = True  # its host copies are this rank's memory
        else:
            reference.weights = 0.0  # host copies (trainer/ppo/reference_swap.py), one parameter of device scratch
            notes.append("ppo.reference_mode=swap: the reference weights wait in host memory and run in the "
                         "policy's model")
    frozen_weights = max(reference.weights, reward.weights) if offload else 0.0
    # During the rollout, gradients and optimizer state of both trained models wait in host memory
    # (rollout/offload.py), and so do the policy's training weights while a copy of them generates.
    in_host = policy.gradients + policy.optimizer + value.gradients + value.optimizer
    if copy_generates and cfg.rollout.release_training_weights:
        in_host += policy.weights
    if cluster.cpu:
        in_host = 0.0
    phases = {
        "train_policy": policy.activations,
        "train_value": value.activations,
        "rollout": policy.kv_cache + policy.generation_weights - in_host,
        "score": frozen_weights + max(reference.activations, reward.activations),
    }
    if own_layout and cfg.rollout.tp is None:
        notes.append(f"training layout {train_layout} needs the hybrid engine's generation layout (rollout.tp)")
    return Plan("ppo", world, dp, [policy, value, reference, reward], phases, _usable(cluster), notes=notes)


def _plan_dpo(cfg, cluster, arch, layout, trained_kw, frozen_kw, act, notes) -> Plan:
    """The policy trains on chosen and rejected rows together (2 x train.micro_batch_size rows per micro-batch).
    The frozen reference (training layout) is built first: with dpo.reference_logprobs=online it stays on the
    GPU; with `precompute` it computes the table before the policy exists and is freed (that phase's extra, over
    a resident state it does not share, may be negative). With dpo.eval_prompts_path, both policies sample the
    held-out prompts after the last step (this rank's share in one batch), the precomputing run's reference
    loaded again."""
    t, d, world = cfg.train, cfg.dpo, cluster.world
    dp = cfg.parallel.dp(world)
    seq, rows = cfg.data.max_seq_len, 2 * t.micro_batch_size
    [ref] = other_models(cfg)
    policy = model_memory("policy", arch, layout, "lm", **trained_kw)
    reference = model_memory("reference", ref.arch, layout, "lm", **frozen_kw)
    nmb = t.global_batch_size // (t.micro_batch_size * dp)
    policy.activations = activation_bytes(arch, layout, act(rows, seq, nmb), "lm")
    reference.activations = inference_bytes(ref.arch, layout, rows, seq, "lm")
    reference.resident = d.reference_logprobs == "online"
    reference.away = "only before the policy is built, for the reference log-probs"
    alone = 0.0 if reference.resident else reference.weights - policy.state
    phases = {"train": policy.activations, "reference_logprobs": alone + reference.activations}
    if d.eval_prompts_path is not None:
        share, length = -(-d.eval_prompts // dp), (cfg.data.max_prompt_len or seq) + d.max_new_tokens
        again = 0.0 if reference.resident else reference.weights  # an online reference is the one evaluated
        phases["eval"] = again + max(kv_cache_bytes(a, layout.tp, share, length) for a in (arch, ref.arch))
    return Plan("dpo", world, dp, [policy, reference], phases, _usable(cluster), notes=notes)


# Single changes tried in this order, cheapest first; the first whose plan fits is suggested.
def _candidates(cfg, stage: str, cluster: Cluster):
    p, t = cfg.parallel, cfg.train
    if stage == "dpo" and cfg.dpo.reference_logprobs == "online":  # the same reference forwards, done up front
        yield "dpo.reference_logprobs=precompute", {"dpo.reference_logprobs": "precompute"}, None
    if not p.use_distributed_optimizer and p.dp(cluster.world) > 1:
        yield "parallel.use_distributed_optimizer=true", {"parallel.use_distributed_optimizer": True}, None
    if p.recompute is None:
        yield "parallel.recompute=selective", {"parallel.recompute": "selective"}, None
    if p.recompute != "full":
        yield "parallel.recompute=full", {"parallel.recompute": "full"}, None
    if t.micro_batch_size > 1:
        yield f"train.micro_batch_size={t.micro_batch_size // 2}", {"train.micro_batch_size": t.micro_batch_size // 2}, None
    if stage == "ppo" and not cfg.ppo.offload_frozen and not cluster.cpu:
        yield "ppo.offload_frozen=true", {"ppo.offload_frozen": True}, None
    if p.tp * 2 <= cluster.gpus_per_node:
        # DPO's sampled evaluation refuses SP (the Megatron sampler decodes the training layout)
        no_sp = stage == "dpo" and cfg.dpo.eval_prompts_path is not None
        sp = {} if no_sp else {"parallel.sequence_parallel": True}
        yield f"parallel.tp={p.tp * 2}", {"parallel.tp": p.tp * 2, **sp}, None
    yield f"parallel.pp={p.pp * 2}", {"parallel.pp": p.pp * 2}, None
    yield f"--nodes {cluster.nodes * 2}", {}, dataclasses.replace(cluster, nodes=cluster.nodes * 2)


def _with(cfg, changes: dict):
    new = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        group, key = dotted.split(".")
        setattr(getattr(new, group), key, value)
    return new


def suggest_change(cfg, stage: str, cluster: Cluster) -> str:
    """The first single change (cheapest first) under which the plan fits, as an override to type."""
    from megatron_rlhf.config.fields import ConfigError

    for text, changes, new_cluster in _candidates(cfg, stage, cluster):
        try:
            if plan_stage(_with(cfg, changes), stage, new_cluster or cluster, suggest=False).fits:
                return text
        except (LayoutError, ConfigError):
            continue  # that change breaks a divisibility: not a suggestion
    levers = ["more TP/PP", "recompute"]
    if stage == "ppo" and not cluster.cpu:
        levers.append("ppo.offload_frozen")
    if stage == "dpo" and cfg.dpo.reference_logprobs == "online":
        levers.append("dpo.reference_logprobs=precompute")
    return f"no single change fits: combine {', '.join(levers)} and more nodes"
