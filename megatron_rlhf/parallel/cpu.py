"""The small layer that lets the pinned megatron-core run on CPU (tests and tiny runs).

Megatron-Core 0.16.1 has no CPU path: it names CUDA in many places. This module is the only
place in the project that knows the difference between CPU and GPU. `enable()` is a no-op when
CUDA is available; otherwise it neutralises exactly these CUDA assumptions (each was hit on CPU):

1. CUDA named in megatron code: ``torch.cuda.current_device()`` returns ``"cpu"`` and
   ``set_device`` / ``device_count`` are harmless. The remaining CUDA literals sit in a fixed list
   of megatron functions (`CUDA_LITERAL_SITES`): ``device="cuda"`` (causal masks, pipeline token
   counters, grad-norm buffers, optimizer loss scale / grad scalers) and ``'torch.cuda.FloatTensor'``
   -style names compared with ``Tensor.type()`` (the optimizers); and ``.cuda()`` in one function
   (`CUDA_METHOD_SITES`: the all-reduce of tied embeddings). Each function's code is rewritten
   once, at `enable()`, to name the CPU instead (string constants, or the ``cuda`` attribute name,
   in its code object), so they cost nothing per call and nothing else in the process is touched:
   no global ``TorchFunctionMode``, whose Python hook cost ~10 us on every torch call of the
   process (~40% of a small model's decoding time, measured by benchmarks/rollout.py's shape). The list is what a ``TorchFunctionMode`` that logged every CUDA device, ``.cuda()``
   and ``.type()`` it had to rewrite found over the tests' paths (build at TP/PP/VPP, the three
   schedules, Adam incl. the distributed optimizer in fp32 and bf16, fp16 grad scalers, clipping,
   dist_checkpointing save/load, KV-cache decoding, ``resharding.swap_model_weights``), plus the
   sliding-window mask next to the causal one. A megatron path outside it fails loudly with
   "Torch not compiled with CUDA enabled" at the megatron line to add here.
2. The RNG tracker: ``torch.cuda.{get,set}_rng_state/manual_seed`` and Megatron's
   ``_get_cuda_rng_state/_set_cuda_rng_state`` use the CPU generator, so
   ``model_parallel_cuda_manual_seed`` (still required before building a model) and
   ``get_cuda_rng_tracker().fork()`` work.
3. ``torch.cuda.synchronize`` (and stream helpers used by the resharding copy service) are no-ops.
4. ``clip_grad_by_total_norm_fp32`` asserts CUDA gradients: replaced by a CPU version that scales
   the gradients in place by the same rule, so gradient clipping still works. The gradient norm's
   per-tensor sums of squares are dot products (`_l2_norm_cpu`): faster and closer to float64.
5. Model settings (`transformer_config_overrides`): CPU initialisation, no fused CUDA kernels, and
   unbatched pipeline send/recv (batched isend/irecv on gloo races in the interleaved schedule:
   later microbatches read wrong activations). `use_te_activation_func` makes Megatron's MLP call the
   layer spec's whole-GLU activation module: `models/norm_glu.py`'s `SwiGLU`, which `models/spec.py`
   puts there (with its `RMSNorm`) on CPU; Transformer Engine plays no part in it.
6. ``dist_checkpointing`` needs ``psutil`` (checked here, because a missing one hangs the other rank)
   and, left alone, starts a ``spawn`` manager (ours keeps its queue in the rank instead:
   parallel/lifetime.py); entry points stay import-safe (``if __name__ == "__main__"``) all the same.

7. Start-up: megatron-core's import wraps its fusion helpers in ``torch.compile``, which pulls in
   dynamo and inductor (~2.8 s per rank). `parallel/eager_import.py` (installed by the package's
   ``__init__``, before megatron-core can be imported) leaves them uncompiled when there is no CUDA;
   none of them runs on CPU here (item 5).

8. Gradient accumulation fusion (`fuse_grad_accumulation`, called for DDP-wrapped chunks): Megatron's linear
   layers can add their weight gradient straight into DDP's `main_grad` buffer, through Apex's CUDA
   extension `fused_weight_gradient_mlp_cuda`. Without it each weight gradient is a fresh tensor that
   DDP's hook then adds into `main_grad` (2 x 540 MB per backward of a 135M fp32 model: page faults
   and an extra read-modify-write of the buffer). Here a CPU stand-in does the same accumulation as one
   GEMM into the buffer (`addmm_`, beta 1): 3-4% off a forward+backward of the 135M model in fp32. Only
   where the weight's dtype is the buffer's (fp32): a bf16 product must be rounded to bf16 and added to
   the fp32 buffer either way, and measured, the fused order was no faster there. The output layer that
   uses the tied embedding accumulates the same way into the embedding's buffer, and the embedding lookup
   (any dtype) adds its gradient rows into it with one `index_add_` instead of a dense [V, H] gradient: per
   backward of the tied 135M model, three 113 MB tensors (two gradients and their sum) and their passes fewer.

9. Attention precision (`attention_dtype`): torch's CPU flash attention runs its backward in bf16 at twice
   its fp32 time (11.9 ms against 6.1 ms for one forward+backward of a SmolLM2-135M layer at 8 x 80
   tokens, fp32 inputs upcast included), so bf16 attention computes in fp32 on CPU, in every mode: the
   forward-only passes that give PPO its old log-probs must compute what the training forward does
   (ratio 1 on the first minibatch). Not a GPU matter: a CUDA tensor keeps its dtype.
10. Host memory (`_keep_freed_memory`, at `enable()`): glibc hands every block over 32 MB straight back to the
   OS when it is freed (and trims the heap's top), so each large fresh tensor (logits, gradients, the
   log-prob kernel's blocks after a trim) is page-faulted in and zeroed by the kernel again, page by page.
   Freed memory stays in the process for the next tensor instead, as a GPU caching allocator keeps it
   (M_MMAP_MAX 0, M_TRIM_THRESHOLD 1 GiB); the resident set stays near its peak.
   `MEGATRON_RLHF_HOST_MALLOC=default` leaves glibc's policy alone.
11. Half-precision matrix products (`gemm_is_native`, `preferred_dtype`): torch runs bf16 (fp16) GEMMs on CPU
   through oneDNN only where the CPU has the AVX-512 (AVX512-FP16/AMX) instructions oneDNN needs; elsewhere
   it falls back to its reference GEMM. On an AVX2-only AMD EPYC (family 25, 2 threads, 2026-12-04) a
   [640, 576] x [576, 1536] product took 943 ms in bf16 against 9.0 ms in fp32 (1.2 against 126 GFLOP/s),
   so a bf16 run there is ~100x slower, not faster. `start_run` says so in one line, and the real-model
   recipe picks bf16 only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX).
12. Gradient buffers zeroed by their first write (`parallel/grad_buffer.py`): for half-precision weights,
   DDP's backward hook copies a step's first gradient into `main_grad` instead of adding it to a zeroed
   buffer (item 8's lookup zeroes first); the training step marks those buffers instead of zeroing them.

The layer is checked against the installed megatron-core version and refuses any other one,
because each patch targets a specific release's internals.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import importlib.util
import os
import resource
import types
from typing import Any, Tuple

import torch

from megatron_rlhf.parallel import grad_buffer, megatron_version

_enabled = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


# torch's own test of whether its CPU matrix products in a half dtype go through oneDNN (item 11)
_ONEDNN_HALF_CHECK = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}


def gemm_is_native(dtype: str) -> bool:
    """Whether torch's matrix products in `dtype` ("float32" | "bfloat16" | "float16") run on optimised
    kernels here; False for a half dtype on a CPU where torch falls back to its reference GEMM (item 11)."""
    if dtype not in _ONEDNN_HALF_CHECK or cuda_available():
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, _ONEDNN_HALF_CHECK[dtype])())
    except (AttributeError, RuntimeError):  # a torch without the check: assume the reference GEMM
        return False


def slow_dtype_warning(dtype: str) -> str:
    """One line for a run in `dtype` whose GEMMs take torch's reference kernel on this CPU, else ""."""
    if gemm_is_native(dtype):
        return ""
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"warning: model.params_dtype={dtype}: this CPU ({capability}) lacks the instructions torch's "
            f"{dtype} matrix products need, so they run its reference kernel, about 100x slower than float32 "
            f"(parallel/cpu.py item 11); set model.params_dtype=float32 on this machine")


def preferred_dtype() -> str:
    """The faster training dtype here: bfloat16 on CUDA and on CPUs that multiply bf16 in hardware
    (AVX512-BF16 or AMX), float32 elsewhere, where bf16 is emulated at best (item 11)."""
    if cuda_available():
        return "bfloat16"
    cpu_has = [getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                     "_is_amx_tile_supported")]
    return "bfloat16" if any(cpu_has) and gemm_is_native("bfloat16") else "float32"


def transformer_engine_available() -> bool:
    """TE is usable only when it is installed and CUDA is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def peak_memory_gib() -> float:
    """Peak memory of this process in GiB: CUDA allocator peak on GPU, peak resident set on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # Linux reports ru_maxrss in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# Megatron functions whose code names CUDA, as (module, qualified name). Found by logging, with a
# stack, every call where a global CUDA->CPU TorchFunctionMode had to change something (module
# docstring, item 1); each entry is rewritten by `_point_at_cpu`.
CUDA_LITERAL_SITES = (  # string constants
    # device="cuda"
    ("megatron.core.transformer.utils", "get_default_causal_mask"),  # every forward with a causal mask
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),  # token counter
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("megatron.core.utils", "local_multi_tensor_l2_norm"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__"),
    ("megatron.core.optimizer.grad_scaler", "MegatronGradScaler.__init__"),
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.__init__"),
    # 'torch.cuda.{Float,Half,BFloat16}Tensor' compared with param.type()
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
)
CUDA_LITERAL_SITES_BY_RELEASE = {  # sites that only some releases have, by (major, minor)
    (0, 19): (
        ("megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group"),  # a flag's all-reduce
    ),
}
CUDA_METHOD_SITES = (  # `x.cuda()` -> `x.cpu()`: the function's only use of the name `cuda`
    # weight.data.cuda() before the all-reduce of tied embeddings (pp > 1)
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    # send_tensor.cuda() before gathering the distributed optimizer's shards for a checkpoint (its
    # `torch.cuda.current_device()` becomes `torch.cpu.current_device()`, which is "cpu" as well)
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"),
)

_CPU_CONSTANTS = {
    "cuda": "cpu",
    "torch.cuda.FloatTensor": "torch.FloatTensor",
    "torch.cuda.HalfTensor": "torch.HalfTensor",
    "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor",
}
_CPU_NAMES = {"cuda": "cpu"}  # attribute names: tensor.cuda() -> tensor.cpu()


def _rewrite_code(code: types.CodeType, names: bool = False) -> Tuple[types.CodeType, int]:
    """`code` with the CUDA string constants (also inside tuples) replaced by their CPU twins, nested
    functions included; with `names`, the attribute name `cuda` instead (no constants). Returns the
    new code and how many replacements were made."""

    def const(c):
        if isinstance(c, str) and not names:
            return _CPU_CONSTANTS.get(c, c), int(c in _CPU_CONSTANTS)
        if isinstance(c, tuple):
            pairs = [const(x) for x in c]
            return tuple(x for x, _ in pairs), sum(n for _, n in pairs)
        if isinstance(c, types.CodeType):
            return _rewrite_code(c, names)
        return c, 0

    pairs = [const(c) for c in code.co_consts]
    co_names = tuple(_CPU_NAMES.get(n, n) for n in code.co_names) if names else code.co_names
    changed = sum(n for _, n in pairs) + sum(a != b for a, b in zip(co_names, code.co_names))
    return code.replace(co_consts=tuple(c for c, _ in pairs), co_names=co_names), changed


def _point_at_cpu(module: str, qualname: str, names: bool = False) -> None:
    """Rewrite one megatron function in place (every imported reference to it sees the change)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    fn = getattr(obj, "__func__", obj)  # classmethod/staticmethod
    code, changed = _rewrite_code(fn.__code__, names)
    if not changed:
        raise RuntimeError(
            f"megatron_rlhf's CPU layer: {module}.{qualname} no longer names CUDA; the megatron-core "
            f"release {megatron_version.installed()} differs from those the lists were made for: update "
            "CUDA_LITERAL_SITES / CUDA_METHOD_SITES"
        )
    fn.__code__ = code


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: work on CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return None


def transformer_config_overrides() -> dict:
    """TransformerConfig settings that differ on CPU (see item 5 of the module docstring); {} on GPU."""
    if cuda_available():
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,
        use_te_activation_func=True,
    )


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of megatron's clip: grads *= max_norm / (total_norm + 1e-6) when that is < 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _l2_norm_cpu(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """CPU stand-in for Apex's `multi_tensor_l2norm` in Megatron's gradient norm (item 4): each gradient's sum
    of squares as one dot product, summed in float64. Megatron's fallback takes `torch.norm` of each, whose
    fp32 reduction runs at half a dot product's speed on CPU and drifted 1.5e-3 relative from float64 over a
    28M-element tensor (the dot product: 2e-5). Returns ([1] norm, None), as the fallback does."""
    total = torch.zeros((), dtype=torch.float64)
    for tensor in tensor_lists[0]:
        flat = tensor.reshape(-1)
        flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        total += torch.dot(flat, flat).double()
    return total.sqrt().float().reshape(1), None


class _WgradAccumulation:
    """CPU stand-in for Apex's `fused_weight_gradient_mlp_cuda`: main_grad += grad_output^T @ input in one
    GEMM. total_input [N, in], grad_output [N, out] (Megatron flattens them to 2-D first), main_grad
    [out, in], all fp32 (`fuse_grad_accumulation` switches only such layers on)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t(), total_input)


class _LookupIntoMainGrad(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose backward adds each token's gradient row into `weight.main_grad`
    (DDP's buffer) with one `index_add_`, and gives autograd no weight gradient. The dense backward wrote a
    zero [V, H] tensor (113 MB at a 49k vocabulary), scattered into it, and DDP's hook then added all of it
    to the buffer. ids [b, s] -> [b, s, H]."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        if grad_buffer.first_write(main_grad):  # the rows cover only the tokens seen (item 12)
            main_grad.zero_()
        main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype))
        return None, None


class _EmbeddingFunctional:
    """`torch.nn.functional` as megatron's tensor_parallel/layers.py sees it (its one use: F.embedding in
    VocabParallelEmbedding.forward): a weight that `fuse_grad_accumulation` marked looks up through
    `_LookupIntoMainGrad` while gradients are on; everything else is torch's own."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def embedding(input, weight, *args, **kwargs):
        if getattr(weight, "lookup_into_main_grad", False) and torch.is_grad_enabled() and weight.requires_grad:
            if args or kwargs:  # a dense gradient here would meet a tied output layer's unzeroed dummy: refuse
                raise RuntimeError(
                    "megatron_rlhf's CPU layer: F.embedding with extra arguments on a weight whose gradient goes "
                    "straight into DDP's buffer; megatron-core's VocabParallelEmbedding changed (parallel/cpu.py item 8)")
            return _LookupIntoMainGrad.apply(input, weight)
        return torch.nn.functional.embedding(input, weight, *args, **kwargs)


def fuse_grad_accumulation(chunk: torch.nn.Module) -> None:
    """On CPU, let the Megatron layers of a DDP-wrapped chunk accumulate their weight gradients into
    `main_grad` (item 8): linear layers whose weights are fp32, like DDP's buffer, including the output
    layer that uses the tied embedding, and the embedding lookups of any dtype. Only DDP-wrapped chunks:
    every weight then has a `main_grad`, which the fused path requires (a plain model that backpropagates
    keeps the unfused path)."""
    if cuda_available():
        return  # on GPU the config's gradient_accumulation_fusion decides (Apex or TE provide the kernel)
    from megatron.core.tensor_parallel import layers
    from megatron.core.utils import unwrap_model

    layers.fused_weight_gradient_mlp_cuda = _WgradAccumulation
    layers.F = _EmbeddingFunctional()

    def fp32_main_grad(weight) -> bool:
        main_grad = getattr(weight, "main_grad", None)
        return main_grad is not None and main_grad.dtype == weight.dtype == torch.float32

    model = unwrap_model(chunk)
    tied_fused = None  # the tied embedding weight, when the output layer that uses it is fused
    for module in model.modules():
        if isinstance(module, layers.VocabParallelEmbedding) and getattr(module.weight, "main_grad", None) is not None:
            module.weight.lookup_into_main_grad = True
        if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            continue
        weight = getattr(module, "weight", None)
        tied = weight is None and module is getattr(model, "output_layer", None)  # it uses the tied embedding
        if tied:
            weight = model.shared_embedding_or_output_weight()
        if fp32_main_grad(weight):
            module.gradient_accumulation_fusion = True
            tied_fused = weight if tied else tied_fused
    if tied_fused is not None and getattr(tied_fused, "lookup_into_main_grad", False):
        # Both uses of the tied weight write the buffer and give autograd no real gradient, so Megatron's
        # zeroed dummy for the output layer (a fresh [V, H] zero tensor per backward, which DDP's hook then
        # adds to the buffer) can be its unread `empty` one, which the hook skips.
        tied_fused.zero_out_wgrad = False


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype to compute scaled-dot-product attention in, for inputs like `query` (item 9)."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return query.dtype


HOST_MALLOC_ENV = "MEGATRON_RLHF_HOST_MALLOC"


def _keep_freed_memory() -> bool:
    """Item 10: glibc keeps freed memory for reuse. False where it is not glibc or the user opted out."""
    if os.environ.get(HOST_MALLOC_ENV, "") == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own policy stands
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 1 << 30))


def _check_versions() -> None:
    megatron_version.check_supported()
    try:
        import psutil  # noqa: F401
    except ImportError as e:  # pragma: no cover - install-time problem
        raise RuntimeError("psutil is required by megatron's dist_checkpointing: pip install psutil") from e


def enable() -> bool:
    """Install the CPU layer once per process. Returns True if it is active (no CUDA)."""
    global _enabled
    if cuda_available():
        return False
    if _enabled:
        return True
    _check_versions()

    # 1. devices
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0
    for module, qualname in CUDA_LITERAL_SITES + CUDA_LITERAL_SITES_BY_RELEASE.get(megatron_version.release(), ()):
        _point_at_cpu(module, qualname)
    for module, qualname in CUDA_METHOD_SITES:
        _point_at_cpu(module, qualname, names=True)

    # 2. RNG: the "CUDA" generator is the CPU generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 3. synchronisation and streams
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # 4. gradient clipping
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    clip_grads.l2_norm_impl = _l2_norm_cpu

    # 10. host memory: freed large blocks stay in the process
    _keep_freed_memory()

    # 12. gradient buffers zeroed by their first write
    grad_buffer.install_hook()

    # 5. GPU-only advice that is noise here
    import warnings

    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")

    _enabled = True
    return True
