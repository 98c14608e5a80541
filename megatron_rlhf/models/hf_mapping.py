"""The one HF <-> Megatron-Core GPTModel name map (Llama, Mistral, Qwen2), with its transforms.

Three users: offline conversion (`checkpoint/hf.py`), live weight sync into a generation engine
(`iter_hf_weights`), and the parity tests. Everything here is described by `RULES`: one row per
Megatron parameter, naming the HF tensors it is made of and how it is split over tensor-parallel
ranks. Names use ``{}`` for the decoder layer index (global in HF and in checkpoints, local to the
pipeline stage inside a model chunk; `global_name` translates).

Three forms of one weight appear below:
- HF form: the tensors of the HF state dict (`q_proj`, `k_proj`, ... `[out, in]`).
- canonical form: the full Megatron tensor, independent of TP (QKV interleaved per query group,
  fc1 = [gate; up], vocab rows unpadded). This is what the distributed checkpoint stores.
- shard form: what one TP rank holds (vocab padded, fc1 = [gate_r; up_r]).

Kinds of rule (how the canonical tensor is built and split):
- ``replicated``: norms and the scalar head, the same on every TP rank.
- ``column`` / ``row``: split on dim 0 / dim 1.
- ``vocab``: column split of the vocab rows after padding to `ModelConfig.padded_vocab_size(tp)`.
- ``qkv``: q/k/v interleaved per query group ``[q_g (heads_per_group*hd), k_g (hd), v_g (hd)]``;
  groups are contiguous, so a column split gives each rank whole groups.
- ``gate_up``: each rank holds ``[gate_r; up_r]`` (not a slice of ``[gate; up]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.device import compute_device


class ConversionError(ValueError):
    """Bad conversion input. The message is one line naming the culprit and the fix."""


# --------------------------------------------------------------------------------------------
# The declarative map
# --------------------------------------------------------------------------------------------

# Symbolic dimensions, resolved by `_dims`: V vocab (unpadded), H hidden, Q = heads*head_dim,
# KV = query_groups*head_dim, F = ffn hidden size.
Shape = Tuple[object, ...]


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of."""

    local: str  # name under the local layer spec
    hf: Tuple[str, ...]  # HF names, in the order the transform takes them
    kind: str  # replicated | column | row | vocab | qkv | gate_up
    shapes: Tuple[Shape, ...]  # HF shapes (symbolic), one per HF name
    te: Optional[str] = None  # name under the Transformer-Engine-fused spec, when it differs
    when: str = "always"  # always | qkv_bias | lm_untied | scalar

    @property
    def per_layer(self) -> bool:
        return "{}" in self.local

    @property
    def ckpt_key(self) -> str:
        """Key in a Megatron distributed checkpoint: TE names, layers stacked under one key."""
        return (self.te or self.local).replace("layers.{}.", "layers.")

    def names(self) -> Tuple[str, ...]:
        return (self.local,) if self.te is None else (self.local, self.te)

    def megatron_name(self, layer: Optional[int] = None) -> str:
        return self.local.format(layer) if self.per_layer else self.local

    def hf_names(self, layer: Optional[int] = None) -> Tuple[str, ...]:
        return tuple(n.format(layer) for n in self.hf) if self.per_layer else self.hf


_L = "model.layers.{}."
_D = "decoder.layers.{}."
RULES: Tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", (("V", "H"),)),
    Rule(
        _D + "input_layernorm.weight",
        (_L + "input_layernorm.weight",),
        "replicated",
        (("H",),),
        te=_D + "self_attention.linear_qkv.layer_norm_weight",
    ),
    Rule(
        _D + "self_attention.linear_qkv.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
        "qkv",
        (("Q", "H"), ("KV", "H"), ("KV", "H")),
    ),
    Rule(
        _D + "self_attention.linear_qkv.bias",
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
        "qkv",
        (("Q",), ("KV",), ("KV",)),
        when="qkv_bias",
    ),
    Rule(_D + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row", (("H", "Q"),)),
    Rule(
        _D + "pre_mlp_layernorm.weight",
        (_L + "post_attention_layernorm.weight",),
        "replicated",
        (("H",),),
        te=_D + "mlp.linear_fc1.layer_norm_weight",
    ),
    Rule(
        _D + "mlp.linear_fc1.weight",
        (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
        "gate_up",
        (("F", "H"), ("F", "H")),
    ),
    Rule(_D + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row", (("H", "F"),)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", (("H",),)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", (("V", "H"),), when="lm_untied"),
    # Reward/value models: our ScalarHead ([1, H], replicated) is HF's sequence-classification `score`.
    Rule("output_layer.weight", ("score.weight",), "replicated", ((1, "H"),), when="scalar"),
)

# Modules whose `_extra_state` Megatron stores as a ShardedObject per layer. The converter writes
# them (as None) so a checkpoint it makes loads with a model's full sharded_state_dict. The local
# spec has the first four; `core_attention` exists only under the TE spec (TE accepts None).
EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "self_attention.core_attention",
)

# HF tensors that are not parameters (old Llama checkpoints store RoPE buffers); skipped on input.
IGNORED_HF = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)

FAMILY_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def normalize_head(head: str) -> str:
    """'lm' or 'scalar' (HF's 'score' / sequence classification is our 'scalar')."""
    if head in ("lm", "scalar"):
        return head
    if head == "score":
        return "scalar"
    raise ConversionError(f"unknown head {head!r}: use 'lm' (causal LM) or 'scalar' (reward/value model)")


def _applies(rule: Rule, cfg: ModelConfig, head: str) -> bool:
    head = normalize_head(head)
    return {
        "always": True,
        "qkv_bias": cfg.add_qkv_bias,
        "lm_untied": head == "lm" and not cfg.tie_embeddings,
        "scalar": head == "scalar",
    }[rule.when]


def rules_for(cfg: ModelConfig, head: str = "lm") -> List[Rule]:
    """The rules that apply to this model (bias, tied embeddings and head decide)."""
    return [r for r in RULES if _applies(r, cfg, head)]


def _dims(cfg: ModelConfig) -> Dict[str, int]:
    return {
        "V": cfg.vocab_size,
        "H": cfg.hidden_size,
        "Q": cfg.num_attention_heads * cfg.head_dim,
        "KV": cfg.num_query_groups * cfg.head_dim,
        "F": cfg.ffn_hidden_size,
    }


def hf_shapes(rule: Rule, cfg: ModelConfig) -> List[Tuple[int, ...]]:
    dims = _dims(cfg)
    return [tuple(dims[d] if isinstance(d, str) else d for d in s) for s in rule.shapes]


def canonical_shape(rule: Rule, cfg: ModelConfig) -> Tuple[int, ...]:
    """Shape of the full, TP-independent Megatron tensor (vocab unpadded)."""
    shapes = hf_shapes(rule, cfg)
    if rule.kind in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


def layers(rule: Rule, cfg: ModelConfig) -> List[Optional[int]]:
    return list(range(cfg.num_layers)) if rule.per_layer else [None]


def iter_entries(cfg: ModelConfig, head: str = "lm") -> Iterator[Tuple[Rule, Optional[int]]]:
    """(rule, global layer) in HF order: embedding, each layer in turn, final norm, head."""
    rules = rules_for(cfg, head)
    for r in rules:
        if not r.per_layer and r.local.startswith("embedding"):
            yield r, None
    for layer in range(cfg.num_layers):
        for r in rules:
            if r.per_layer:
                yield r, layer
    for r in rules:
        if not r.per_layer and not r.local.startswith("embedding"):
            yield r, None


def expected_hf_shapes(cfg: ModelConfig, head: str = "lm") -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name this model has (as `save_pretrained` writes it) -> its shape, in order."""
    out: Dict[str, Tuple[int, ...]] = {}
    for rule, layer in iter_entries(cfg, head):
        out.update(zip(rule.hf_names(layer), hf_shapes(rule, cfg)))
    return out


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(r"\{\}", r"(\d+)") + "$")


_MEGATRON_PATTERNS = [(p, r) for r in RULES for p in map(_pattern, r.names())]
_HF_PATTERNS = [(_pattern(n), r, i) for r in RULES for i, n in enumerate(r.hf)]


def match_megatron(name: str, cfg: ModelConfig, head: str = "lm") -> Tuple[Rule, Optional[int]]:
    """A Megatron parameter name (local or TE spec, global layer index) -> (rule, layer)."""
    for pat, rule in _MEGATRON_PATTERNS:
        m = pat.match(name)
        if m and _applies(rule, cfg, head):
            return rule, (int(m.group(1)) if rule.per_layer else None)
    raise ConversionError(f"no HF mapping for Megatron parameter {name!r} (head={normalize_head(head)})")


def match_hf(name: str, cfg: ModelConfig, head: str = "lm") -> Tuple[Rule, Optional[int], int]:
    """An HF tensor name -> (rule, layer, position among the rule's HF tensors)."""
    for pat, rule, i in _HF_PATTERNS:
        m = pat.match(name)
        if m and _applies(rule, cfg, head):
            return rule, (int(m.group(1)) if rule.per_layer else None), i
    raise ConversionError(f"unexpected tensor {name!r}: it has no place in a {cfg.family} model with head={head}")


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP size the weights cannot be split by (one line naming the numbers)."""
    for what, n in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_query_groups (num_key_value_heads)", cfg.num_query_groups),
        ("ffn_hidden_size (intermediate_size)", cfg.ffn_hidden_size),
    ):
        if tp < 1 or n % tp != 0:
            raise ConversionError(f"tensor parallel size {tp} does not divide {what}={n}: pick a TP that divides {n}")


# --------------------------------------------------------------------------------------------
# Transforms between the three forms
# --------------------------------------------------------------------------------------------


def qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q [nh*hd, ...], k/v [ng*hd, ...] -> Megatron [ng*(nh/ng+2)*hd, ...], per group [q_g, k_g, v_g].

    Works for weights ([*, H]) and biases ([*]).
    """
    ng, hd = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // ng
    rest = q.shape[1:]
    merged = torch.cat(
        [q.reshape(ng, per_group * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1
    )
    return merged.reshape(-1, *rest)


def qkv_split(qkv: torch.Tensor, cfg: ModelConfig) -> List[torch.Tensor]:
    """Inverse of `qkv_merge`: Megatron interleaved QKV -> [q, k, v] (contiguous copies)."""
    ng, hd = cfg.num_query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def to_canonical(rule: Rule, hf_tensors: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """HF tensors of one rule -> the full Megatron tensor."""
    if rule.kind == "qkv":
        return qkv_merge(*hf_tensors, cfg)
    if rule.kind == "gate_up":
        return torch.cat(list(hf_tensors), dim=0)
    (t,) = hf_tensors
    return t


def from_canonical(rule: Rule, t: torch.Tensor, cfg: ModelConfig) -> List[torch.Tensor]:
    """The full Megatron tensor -> the HF tensors of one rule."""
    if rule.kind == "qkv":
        return qkv_split(t, cfg)
    if rule.kind == "gate_up":
        return [c.contiguous() for c in torch.chunk(t, 2, dim=0)]
    return [t]


def shard(rule: Rule, t: torch.Tensor, cfg: ModelConfig, tp: int, rank: int) -> torch.Tensor:
    """Full Megatron tensor -> the slice TP rank `rank` of `tp` holds (vocab padded with zero rows)."""
    if rule.kind == "replicated" or tp == 1 and rule.kind != "vocab":
        return t
    if rule.kind in ("column", "qkv"):
        return torch.chunk(t, tp, dim=0)[rank]
    if rule.kind == "row":
        return torch.chunk(t, tp, dim=1)[rank]
    if rule.kind == "gate_up":
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]], dim=0)
    if rule.kind == "vocab":
        # Zero rows, as Megatron's checkpoint loader leaves padding (allow_shape_mismatch -> zeros).
        padded = cfg.padded_vocab_size(tp)
        rows = padded // tp
        start, stop = rank * rows, min((rank + 1) * rows, t.shape[0])
        out = t.new_zeros((rows, *t.shape[1:]))
        if stop > start:
            out[: stop - start] = t[start:stop]
        return out
    raise AssertionError(rule.kind)


def unshard(rule: Rule, shards: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """TP shards (in rank order) -> the full Megatron tensor (vocab padding trimmed)."""
    if rule.kind == "replicated" or len(shards) == 1 and rule.kind != "vocab":
        return shards[0]
    if rule.kind in ("column", "qkv"):
        return torch.cat(list(shards), dim=0)
    if rule.kind == "row":
        return torch.cat(list(shards), dim=1)
    if rule.kind == "gate_up":
        pairs = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
    if rule.kind == "vocab":
        return torch.cat(list(shards), dim=0)[: cfg.vocab_size]
    raise AssertionError(rule.kind)


def check_hf_shape(name: str, found: Sequence[int], expected: Sequence[int]) -> None:
    if tuple(found) != tuple(expected):
        raise ConversionError(f"shape mismatch for {name}: expected {tuple(expected)}, found {tuple(found)}")


# --------------------------------------------------------------------------------------------
# Live models: global names, loading full HF tensors, streaming full HF tensors out
# --------------------------------------------------------------------------------------------


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model  # DDP and Float16Module wrap the GPTModel as `.module`

    return unwrap_model(module)


_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.*)$")


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """A chunk's parameter name with its PP-local layer index replaced by the global one."""
    m = _LAYER_NAME.match(name)
    if not m:
        return name
    layer = _unwrap(chunk).decoder.layers[int(m.group(1))].layer_number - 1  # layer_number is 1-based
    return f"decoder.layers.{layer}.{m.group(2)}"


def named_global_parameters(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.nn.Parameter]:
    out = {}
    for chunk in model_chunks:
        for name, p in _unwrap(chunk).named_parameters():
            out[global_name(chunk, name)] = p
    return out


def _tp_pp():
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_group(),
    )


def _is_tied_copy(name: str, cfg: ModelConfig, head: str) -> bool:
    # With tied embeddings and PP > 1 the last stage keeps a copy of the embedding as output_layer.
    return name == "output_layer.weight" and cfg.tie_embeddings and normalize_head(head) == "lm"


@torch.no_grad()
def load_hf_weights(
    model_chunks: Sequence[torch.nn.Module],
    cfg: ModelConfig,
    head: str,
    get_tensor: Callable[[str], torch.Tensor],
) -> None:
    """Fill this rank's model chunks from full HF tensors; each rank copies its own TP slice.

    `get_tensor(hf_name)` returns the full HF tensor (lazily, e.g. from safetensors). Needs
    Megatron's parallel state for the TP size/rank. No communication: every rank reads what it needs.
    """
    tp, tp_rank, *_ = _tp_pp()
    check_tp(cfg, tp)
    for name, param in named_global_parameters(model_chunks).items():
        if name.endswith("_extra_state"):
            continue
        if _is_tied_copy(name, cfg, head):
            rule, layer = match_megatron("embedding.word_embeddings.weight", cfg, head)
        else:
            rule, layer = match_megatron(name, cfg, head)
        hf = []
        for hf_name, shape in zip(rule.hf_names(layer), hf_shapes(rule, cfg)):
            t = get_tensor(hf_name)
            check_hf_shape(hf_name, t.shape, shape)
            hf.append(t)
        local = shard(rule, to_canonical(rule, hf, cfg), cfg, tp, tp_rank)
        if tuple(local.shape) != tuple(param.shape):
            raise ConversionError(
                f"shape mismatch for Megatron {name}: model has {tuple(param.shape)}, the HF tensors "
                f"give {tuple(local.shape)} at TP={tp}: the model config does not match the checkpoint"
            )
        param.copy_(local)


@torch.no_grad()
def iter_hf_weights(
    model_chunks: Sequence[torch.nn.Module], cfg: ModelConfig, head: str = "lm"
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF tensor of the model, on every rank, in HF order.

    A collective: all ranks must iterate it to the end in lockstep. Per Megatron parameter, the
    pipeline stage that owns it all-gathers the TP shards (trimming vocab padding) and broadcasts
    the full tensor to the other stages. The yielded tensors are fresh (safe to keep or send).
    Names and shapes are exactly `expected_hf_shapes(cfg, head)`.
    """
    import torch.distributed as dist

    head = normalize_head(head)
    tp, _tp_rank, tp_group, pp, pp_rank, pp_group = _tp_pp()
    params = named_global_parameters(model_chunks)
    local = {n: p for n, p in params.items() if not n.endswith("_extra_state") and not _is_tied_copy(n, cfg, head)}
    for n in local:
        match_megatron(n, cfg, head)  # a parameter the map does not know is a bug: fail loudly
    # Which stage owns which parameter: one object all-gather up front, then only tensor traffic.
    if pp > 1:
        owned: List[Dict[str, torch.dtype]] = [None] * pp  # type: ignore[list-item]
        dist.all_gather_object(owned, {n: p.dtype for n, p in local.items()}, group=pp_group)
    else:
        owned = [{n: p.dtype for n, p in local.items()}]
    for rule, layer in iter_entries(cfg, head):
        name = rule.megatron_name(layer)
        owners = [r for r in range(pp) if name in owned[r]]
        if not owners:
            raise ConversionError(f"Megatron parameter {name} is on no pipeline stage: model and config disagree")
        src = owners[0]
        if pp_rank == src:
            p = local[name].detach()
            if tp > 1 and rule.kind != "replicated":
                shards = [torch.empty_like(p) for _ in range(tp)]
                dist.all_gather(shards, p.contiguous(), group=tp_group)
            else:
                shards = [p]
            full = unshard(rule, shards, cfg).clone()
        else:
            full = torch.empty(canonical_shape(rule, cfg), dtype=owned[src][name], device=compute_device())
        if pp > 1:
            dist.broadcast(full, src=dist.get_global_rank(pp_group, src), group=pp_group)
        yield from zip(rule.hf_names(layer), from_canonical(rule, full, cfg))
