"""The `rollout` config group of `megatron-rlhf ppo`: where and with what the policy generates.

    rollout.engine    megatron (the KV-cache sampler, CPU and GPU) or vllm (GPU only)
    rollout.tp        generation layout: TP=tp, PP=1, DP=world/tp; null = the training TP
    rollout.bucket_mb size of the weight buckets streamed to vLLM
    rollout.release_training_weights  GPU: the policy's training weights wait in host memory while a
                      generation copy of them (another layout, vLLM) decodes

The generation layout is independent of the training one (rollout/hybrid.py): a policy trained at
TP=1 x PP=2 generates at TP=1 x DP=2, with its weights resharded before every rollout.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.config.fields import help_field as _f


@dataclass
class RolloutSection:
    """Generation engine and layout of the PPO rollouts."""

    engine: str = _f("megatron", "generation engine: the Megatron KV-cache sampler, or vLLM (GPU only)",
                     choices=("megatron", "vllm"))
    tp: Optional[int] = _f(None, "generation tensor-parallel size (PP=1, DP=world/tp); null = parallel.tp")
    bucket_mb: int = _f(256, "vLLM engine: MiB of HF tensors per weight-update bucket")
    release_training_weights: bool = _f(
        True, "GPU, when generation uses a copy of the weights (rollout.tp != training layout, or vLLM): the "
        "training weights wait in pinned host memory during decoding (no-op on CPU or in the training layout)")


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
    if r.bucket_mb < 1:
        raise ConfigError(f"rollout.bucket_mb={r.bucket_mb} must be >= 1")
    check_layout_tp("rollout.tp", generation_tp(cfg), world, cfg.model.to_model_config(), cfg.parallel.tp)
    if r.engine == "vllm":
        require_vllm()


def require_vllm() -> None:
    """One-line ConfigError when vLLM cannot run here: no CUDA device, or the vllm package missing."""
    from megatron_rlhf.parallel.cpu import cuda_available  # torch: only when the vLLM engine is asked for

    if not cuda_available():
        raise ConfigError("rollout.engine=vllm needs CUDA GPUs and none is visible: use rollout.engine=megatron on CPU")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs the vllm package, which is not installed: "
                          "pip install vllm, or use rollout.engine=megatron")
