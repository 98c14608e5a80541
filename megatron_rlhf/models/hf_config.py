"""A Megatron model's description -> the Hugging Face config.json that describes the same model.

The reverse of `spec.model_config_from_hf`. Used by the HF export (checkpoint/hf.py) and by engines that
load the policy in Hugging Face form (the vLLM engine writes this config, then streams the weights).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rlhf.models import hf_mapping as hm
from megatron_rlhf.models.spec import ModelConfig


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """A config.json for `cfg` when the original HF config is unknown (e.g. a model made in training)."""
    rope = cfg.rope_scaling or {}
    rope_params = {"rope_type": rope.get("type", "default"), "rope_theta": cfg.rotary_base}
    if rope.get("type") == "llama3":
        rope_params.update(
            factor=rope["factor"], low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        )
    elif rope.get("type") == "linear":
        rope_params.update(factor=rope["factor"])
    out = {
        "model_type": cfg.family,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "initializer_range": cfg.init_method_std,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope_params,
    }
    if cfg.family == "llama":
        out.update(attention_bias=cfg.add_qkv_bias, mlp_bias=False)
    if cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if cfg.family == "qwen2":
        # max_window_layers=0: the window applies from layer 0 on, as in Megatron (transformers' default is 28).
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=0)
    return out


def hf_config_for_export(cfg: ModelConfig, head: str, dtype: torch.dtype, base: Optional[dict]) -> dict:
    """The config.json to write: the source's config (if known) with architecture and dtype updated."""
    out = dict(base) if base else hf_config_from_model_config(cfg)
    prefix = hm.FAMILY_CLASS_PREFIX[cfg.family]
    if hm.normalize_head(head) == "lm":
        out["architectures"] = [prefix + "ForCausalLM"]
    else:
        out["architectures"] = [prefix + "ForSequenceClassification"]
        out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}  # one score per sequence
    out.pop("torch_dtype", None)
    out["dtype"] = dtype_name(dtype)
    if not base:
        out["tie_word_embeddings"] = cfg.tie_embeddings
    return out
