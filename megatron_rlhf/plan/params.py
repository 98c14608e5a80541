"""Parameters per GPU of a Megatron `GPTModel` (models/build.py) under a TP/PP/VPP layout, by arithmetic.

The arithmetic follows what Megatron-Core 0.16.1 allocates for our layer spec (local or Transformer
Engine: the same tensors, TE fuses each norm into the next linear layer):

    embedding     padded_vocab/tp * h                       (first pipeline stage, first chunk)
    one layer     2h (two RMSNorms, replicated over TP)
                  + h * (q + 2kv)/tp  [+ (q + 2kv)/tp bias]  (fused QKV, column parallel)
                  + q/tp * h                                (attention output, row parallel)
                  + h * 2f/tp + f/tp * h                    (SwiGLU fc1 and fc2)
    final norm    h                                         (last stage, last chunk)
    output layer  padded_vocab/tp * h  (LM head; none when tied and on the embedding's chunk)
                  or h                 (ScalarHead of value/reward models, replicated)

with q = heads * head_dim, kv = query_groups * head_dim, f = ffn_hidden_size. Tests tie these
numbers to real builds (tests/unit/test_plan_params.py at one rank, and the 2-rank TP/PP/VPP
equivalence runs), so the planner cannot drift from the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_rlhf.models.spec import ModelConfig


@dataclass(frozen=True)
class Layout:
    """How one model is split: tensor, pipeline and virtual pipeline sizes (PP=1 for inference)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None

    def __str__(self) -> str:
        return f"TP={self.tp} PP={self.pp}" + (f" VPP={self.vpp}" if self.vpp else "")


def embedding_params(m: ModelConfig, tp: int) -> int:
    return m.padded_vocab_size(tp) * m.hidden_size // tp


def layer_params(m: ModelConfig, tp: int) -> int:
    """One decoder layer's parameters on one TP rank."""
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.ffn_hidden_size
    qkv = h * (q + 2 * kv) // tp + ((q + 2 * kv) // tp if m.add_qkv_bias else 0)
    return 2 * h + qkv + q * h // tp + h * 2 * f // tp + f * h // tp


def head_params(m: ModelConfig, tp: int, head: str, holds_embedding: bool) -> int:
    """Output layer on the last chunk: LM head (vocab-parallel) or scalar head (replicated)."""
    if head == "scalar":
        return m.hidden_size
    if m.tie_embeddings and holds_embedding:
        return 0  # Megatron reuses the embedding weight on the chunk that holds it
    return embedding_params(m, tp)


def stage_params(m: ModelConfig, layout: Layout, pp_rank: int, head: str = "lm") -> int:
    """Parameters held by pipeline rank `pp_rank` (summed over its virtual chunks), on one TP rank."""
    vpp = layout.vpp or 1
    chunks = layout.pp * vpp
    per_chunk = m.num_layers // chunks
    total = 0
    for vp in range(vpp):
        first = pp_rank == 0 and vp == 0
        last = pp_rank == layout.pp - 1 and vp == vpp - 1
        total += per_chunk * layer_params(m, layout.tp)
        if first:
            total += embedding_params(m, layout.tp)
        if last:
            total += m.hidden_size + head_params(m, layout.tp, head, holds_embedding=first)
    return total


def params_per_rank(m: ModelConfig, layout: Layout, head: str = "lm") -> List[int]:
    """[parameters on pipeline rank r] for r in 0..pp-1 (each TP rank of a stage holds the same count)."""
    return [stage_params(m, layout, r, head) for r in range(layout.pp)]


def params_per_gpu(m: ModelConfig, layout: Layout, head: str = "lm") -> int:
    """The largest per-GPU count over pipeline stages (the one that decides whether a layout fits)."""
    return max(params_per_rank(m, layout, head))


def total_params(m: ModelConfig, head: str = "lm") -> int:
    """Parameters of the whole model (one copy, unpadded vocabulary rounding of TP=1)."""
    return stage_params(m, Layout(), 0, head)
