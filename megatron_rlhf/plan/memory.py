"""Bytes per GPU of one model: state (weights, gradients, optimizer), activations, KV cache.

Model state per parameter, as this code allocates it (trainer/optim.py):

    trained, bf16/fp16 params: 2 (weights) + 4 (fp32 gradient buffer, GRAD_REDUCE_IN_FP32)
                               + 12 (fp32 master copy + Adam m + v; divided by DP with the distributed optimizer)
    trained, fp32 params:      4 + 4 + 8 (Adam m + v; the weights are their own master copy)
    frozen:                    2 (bf16/fp16) or 4 (fp32)
    FP8 (Transformer Engine):  + 2 per trained parameter (the cached FP8 weight and its transpose)

ppo-spec.md's rule of thumb (16 bytes per trained parameter) assumes 16-bit gradients:
`state_bytes_per_param(..., grad_fp32=False)` reproduces it; this code keeps fp32 gradients (18).

Activations (per GPU, while the model trains) follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", adapted to SwiGLU and GQA. Per layer, per token, in
units of the activation dtype size: 4h replicated over TP (two norm inputs, two linear inputs; /tp
with sequence parallelism) + (2q + 2kv + 3f)/tp (Q, K, V, attention output, SwiGLU input and output)
+ a*s/tp (the attention probabilities; not stored with fused/flash attention, which FP8's
Transformer Engine path uses, nor with selective recompute). Full recompute stores only each layer's
input (h, /tp with SP) plus one layer's full set during its backward. The first pipeline stage holds
min(pp, microbatches) microbatches in flight (x (1 + (pp-1)/(pp*vpp)) when interleaved); the last
stage adds fp32 logits (two copies, for the log-softmax and its gradient). An estimate, not a bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import GRAD_REDUCE_IN_FP32
from megatron_rlhf.plan.params import Layout, params_per_gpu

FP8_CACHE_BYTES = 2  # FP8 weight + transpose kept by Transformer Engine for each trained parameter


def dtype_bytes(params_dtype: str) -> int:
    return 4 if params_dtype == "float32" else 2


def state_bytes_per_param(params_dtype: str, trained: bool, dp: int = 1, distributed_optimizer: bool = False,
                          grad_fp32: Optional[bool] = None, fp8: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter on one GPU."""
    w = dtype_bytes(params_dtype)
    if not trained:
        return float(w), 0.0, 0.0
    if grad_fp32 is None:
        grad_fp32 = GRAD_REDUCE_IN_FP32
    grads = 4 if grad_fp32 else w
    optimizer = (4 if w == 2 else 0) + 8  # fp32 master copy (16-bit params only) + Adam m and v
    if distributed_optimizer:
        optimizer /= dp
    return float(w + (FP8_CACHE_BYTES if fp8 else 0)), float(grads), float(optimizer)


@dataclass
class Activations:
    """What decides the activation memory of one training forward/backward."""

    micro_batch: int  # sequences per microbatch (RM: chosen + rejected count twice)
    seq_len: int
    num_microbatches: int  # per optimizer step on one DP rank (bounds the pipeline's in-flight count)
    cp: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None | "selective" | "full"
    flash: bool = False  # fused attention: probabilities not stored


def _per_layer_bytes(m: ModelConfig, tp: int, act: Activations, *, full_layer: bool = False) -> float:
    """Activation bytes of one layer for one microbatch on one GPU."""
    w = dtype_bytes(m.params_dtype)
    s = act.seq_len / act.cp
    tokens = s * act.micro_batch
    rep = m.hidden_size / (tp if act.sequence_parallel else 1)
    if act.recompute == "full" and not full_layer:
        return w * tokens * rep
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    per_token = 4 * rep + (2 * q + 2 * kv + 3 * m.ffn_hidden_size) / tp
    if not act.flash and act.recompute != "selective":
        per_token += m.num_attention_heads * act.seq_len / act.cp / tp
    return w * tokens * per_token


def activation_bytes(m: ModelConfig, layout: Layout, act: Activations, head: str = "lm") -> float:
    """Peak activation bytes on the busiest GPU while the model trains (first or last stage)."""
    per_layer = _per_layer_bytes(m, layout.tp, act)
    layers = m.num_layers // layout.pp
    inflight = min(layout.pp, act.num_microbatches)
    if layout.vpp and layout.pp > 1:
        inflight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    extra = _per_layer_bytes(m, layout.tp, act, full_layer=True) if act.recompute == "full" else 0.0
    first = layers * per_layer * inflight + extra
    logits = 0.0
    if head == "lm":  # fp32 logits and their gradient, vocab-parallel
        logits = 2 * 4 * act.micro_batch * act.seq_len / act.cp * m.padded_vocab_size(layout.tp) / layout.tp
    last = layers * per_layer + extra + logits
    return max(first, last) if layout.pp > 1 else first + logits


def inference_bytes(m: ModelConfig, layout: Layout, micro_batch: int, seq_len: int, head: str) -> float:
    """A forward without gradients (scoring): one layer's activations at a time plus fp32 logits."""
    act = Activations(micro_batch=micro_batch, seq_len=seq_len, num_microbatches=1, flash=False)
    one_layer = _per_layer_bytes(m, layout.tp, act, full_layer=True)
    logits = 2 * 4 * micro_batch * seq_len * m.padded_vocab_size(layout.tp) / layout.tp if head == "lm" else 0.0
    return one_layer + logits


def kv_cache_bytes(m: ModelConfig, tp: int, batch: int, seq_len: int) -> float:
    """Keys and values of every layer for `batch` sequences of `seq_len` tokens on one generation GPU.
    Key/value heads are split over TP (replicated when TP exceeds their number)."""
    groups = max(m.num_query_groups // tp, 1)
    return 2.0 * m.num_layers * groups * m.head_dim * dtype_bytes(m.params_dtype) * batch * seq_len


@dataclass
class ModelMemory:
    """One of the (up to four) models of a stage, in bytes per GPU."""

    name: str  # policy | value | reference | reward
    layout: str
    trained: bool
    params_per_gpu: int
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # while it trains (trained) or scores (frozen)
    kv_cache: float = 0.0  # generation (policy)
    generation_weights: float = 0.0  # the policy's copy in the generation layout, when that differs
    resident: bool = True  # False: frozen weights live in host memory between uses (ppo.offload_frozen)
    away: str = "host memory between uses"  # where a model that is not resident is outside its phases

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def to_dict(self) -> dict:
        return {**asdict(self), "state": self.state}


def model_memory(name: str, m: ModelConfig, layout: Layout, head: str, *, trained: bool, dp: int,
                 distributed_optimizer: bool, fp8: bool) -> ModelMemory:
    """Parameters and state bytes of one model on its busiest GPU (activations are filled in by the planner)."""
    n = params_per_gpu(m, layout, head)
    w, g, o = state_bytes_per_param(m.params_dtype, trained, dp, distributed_optimizer, fp8=fp8 and trained)
    return ModelMemory(name=name, layout=str(layout), trained=trained, params_per_gpu=n,
                       weights=n * w, gradients=n * g, optimizer=n * o)
