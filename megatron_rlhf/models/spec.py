"""Model description: HF `config.json` -> `ModelConfig` -> Megatron `TransformerConfig` + layer spec.

Llama-family decoders only (Llama, Mistral, Qwen2): RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias,
tied or untied embeddings. The Transformer Engine layer spec is used when TE and CUDA are present
(FP8 settings pass through), the local spec otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_rlhf.parallel.layout import Fp8Config, ParallelConfig

# torch is imported inside the functions that need it: config/schema.py (and so `megatron-rlhf --help`)
# imports this module, and importing torch takes seconds.

SUPPORTED_ARCHITECTURES = {
    # HF architecture name -> (family, head)   head: "lm" or "score" (sequence classification)
    "LlamaForCausalLM": ("llama", "lm"),
    "MistralForCausalLM": ("mistral", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "MistralForSequenceClassification": ("mistral", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


class UnsupportedModelError(ValueError):
    """The HF checkpoint is not a Llama-family model this project supports."""


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder, independent of parallel layout."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 4
    kv_channels: Optional[int] = None  # head dim; None = hidden_size / num_attention_heads
    vocab_size: int = 32
    max_position_embeddings: int = 512
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"type": "llama3"|"linear", "factor": float, ...}
    norm_epsilon: float = 1e-5
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    init_method_std: float = 0.02
    sliding_window: Optional[int] = None
    family: str = "llama"  # llama | mistral | qwen2: decides HF names on export
    make_vocab_size_divisible_by: int = 1  # pad the vocab so each TP shard has an equal slice
    params_dtype: str = "float32"  # float32 | bfloat16 | float16

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def torch_dtype(self) -> "torch.dtype":  # noqa: F821
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.params_dtype
        ]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rope_settings(hf: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """rope theta and scaling from both transformers<5 (rope_theta/rope_scaling) and >=5 (rope_parameters)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or None
    if params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "llama3":
        # Megatron-Core 0.16.1 applies llama3 scaling with fixed low/high freq factors and 8192
        # original positions: refuse anything else instead of silently computing other frequencies.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in fixed.items():
            if k in scaling and float(scaling[k]) != v:
                raise UnsupportedModelError(
                    f"rope_scaling {k}={scaling[k]} is not supported (megatron-core 0.16.1 fixes it to {v})"
                )
        return float(theta), {"type": "llama3", "factor": float(scaling.get("factor", 8.0))}
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(scaling["factor"])}
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported: use default, linear or llama3")


def _sliding_window(hf: Mapping[str, Any], family: str) -> Optional[int]:
    """The one attention window every layer uses (None: full attention), or UnsupportedModelError.

    Qwen2 windows only the layers its `layer_types` mark "sliding_attention" (by default the layers
    i >= max_window_layers, and only with use_sliding_window=true); megatron-core 0.16.1 takes one
    window for all layers, so a mix of windowed and full layers is refused rather than approximated.
    """
    window = hf.get("sliding_window")
    if family != "qwen2" or window is None:
        return window
    if not hf.get("use_sliding_window", False):
        return None
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    source = "layer_types"
    if not types:
        first = hf.get("max_window_layers", 28)  # transformers' default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        source = f"max_window_layers={first}"
    windowed = sum(t == "sliding_attention" for t in types)
    if windowed == 0:
        return None
    if windowed == len(types):
        return window
    raise UnsupportedModelError(
        f"use_sliding_window=true windows {windowed} of {len(types)} layers ({source}): per-layer windows are "
        "not supported (megatron-core 0.16.1 applies one window to every layer); use a config whose "
        "max_window_layers is 0 or >= num_hidden_layers"
    )


def model_config_from_hf(hf_config: Any) -> tuple[ModelConfig, str]:
    """Derive a `ModelConfig` from an HF config (dict from config.json or a PretrainedConfig).

    Returns (config, head) where head is "lm" for causal LMs and "score" for sequence classifiers.
    """
    if not isinstance(hf_config, Mapping) and not hasattr(hf_config, "to_dict"):
        raise UnsupportedModelError(
            f"an HF config must be a JSON object of model settings, not a {type(hf_config).__name__}"
        )
    hf = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}: supported are {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family, head = SUPPORTED_ARCHITECTURES[arch]
    else:
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}: supported are {', '.join(sorted(MODEL_TYPES))}"
            )
        family, head = MODEL_TYPES[model_type], "lm"
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf.get('hidden_act')!r} is not supported: only silu (SwiGLU)")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    theta, scaling = _rope_settings(hf)
    heads = hf["num_attention_heads"]
    # Qwen2 always has QKV bias; Llama/Mistral only when attention_bias is set.
    qkv_bias = True if family == "qwen2" else bool(hf.get("attention_bias", False))
    sliding = _sliding_window(hf, family)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
    cfg = ModelConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or None,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rotary_base=theta,
        rope_scaling=scaling,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02),
        sliding_window=sliding,
        family=family,
        params_dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
    )
    return cfg, head


def use_te_spec() -> bool:
    from megatron_rlhf.parallel.cpu import transformer_engine_available  # torch: loaded when a model is built

    return transformer_engine_available()


def layer_spec(te: Optional[bool] = None, sequence_parallel: bool = False):
    """Megatron ModuleSpec for one decoder layer: TE-fused on GPU with TE, local modules otherwise
    (with `SDPAttention` as core attention).

    `te=True` (FP8 runs) insists on Transformer Engine: FP8 never silently becomes a bf16 run.
    `sequence_parallel`: the local spec's norms are ours (models/norm_glu.py) on the GPU too, since
    Megatron's torch fallback (`WrappedTorchNorm`) has no sequence-parallel path."""
    from megatron.core.models.gpt import gpt_layer_specs

    if te and not use_te_spec():
        from megatron_rlhf.parallel.layout import LayoutError

        raise LayoutError("FP8 needs the Transformer Engine layer spec, but CUDA or Transformer Engine is missing: "
                          "pip install 'megatron_rlhf[gpu]' on a GPU machine, or set fp8.format=null")
    if use_te_spec() if te is None else te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    from megatron_rlhf.models.sdpa_attention import SDPAttention
    from megatron_rlhf.parallel import megatron_version
    from megatron_rlhf.parallel.cpu import cuda_available

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention  # one fused op (see its module)
    from megatron_rlhf.models.norm_glu import RMSNorm, SwiGLU

    if not cuda_available():  # one autograd node each (models/norm_glu.py); GPUs keep torch's fused norm
        megatron_version.set_mlp_activation(spec, SwiGLU)  # with use_te_activation_func (parallel/cpu.py)
    if sequence_parallel or not cuda_available():
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    return spec


def decoder_spec(config, te: Optional[bool] = None, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """GPTModel's `transformer_layer_spec` for this pipeline stage: `layer_spec`, or under sequence parallelism
    on the local spec the whole block's spec, so that the block's final norm is ours too (Megatron fills it in
    with `WrappedTorchNorm` otherwise, which asserts on sequence parallelism)."""
    spec = layer_spec(te=te, sequence_parallel=config.sequence_parallel)
    if not config.sequence_parallel or (use_te_spec() if te is None else te):
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_rlhf.models.norm_glu import RMSNorm

    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    fp8: Optional[Fp8Config] = None,
    **overrides: Any,
):
    """Megatron `TransformerConfig` for `model` under `parallel`. Dropout is off (RLHF convention)."""
    import torch
    import torch.nn.functional as F

    from megatron_rlhf.parallel import cpu
    from megatron.core.transformer import TransformerConfig

    dtype = model.torch_dtype()
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        layernorm_epsilon=model.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
    )
    kwargs.update(cpu.transformer_config_overrides())
    if parallel.recompute == "selective":  # recompute core attention only (Megatron's default module list)
        kwargs.update(recompute_granularity="selective")
    elif parallel.recompute == "full":  # store each layer's input only; recompute the layer in backward
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8 is not None and fp8.format is not None:
        kwargs.update(
            fp8=fp8.format,
            fp8_recipe=fp8.recipe,
            fp8_margin=fp8.margin,
            fp8_amax_history_len=fp8.amax_history_len,
            fp8_amax_compute_algo=fp8.amax_compute_algo,
        )
    if model.sliding_window is not None and model.sliding_window < model.max_position_embeddings:
        kwargs["window_size"] = (model.sliding_window - 1, 0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
