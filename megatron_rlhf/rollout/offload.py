"""Memory during generation: training-only state in host memory while the policy decodes, and memory per phase.

    with offloaded([m.policy, m.value]):   # DDP gradient buffers + optimizer state -> host
        generate(...)                      # the device holds weights, KV cache, activations
                                           # back on the device, byte for byte

What moves (per trained model): every Megatron DDP gradient buffer (`buffer.grad_data`, whose views
are `param.main_grad` and the buckets), and every device tensor of the optimizer: Adam's moments and the
fp32 main parameters of mixed precision (distributed optimizer: this rank's shard). Tensors that share
storage with a model parameter stay (an fp32 optimizer steps the model parameters themselves).

How: storage by storage. A storage's bytes are copied to (pinned) host memory and the storage is
resized to 0, which frees the device memory while every tensor viewing it stays a valid object (the
trick Megatron's `offload_grad_buffers` uses); coming back resizes it and copies the bytes in. Unlike
`offload_grad_buffers` (which zeroes the gradients) and `MegatronOptimizer.offload_to_cpu` (which
replaces `p.data` and so cuts an fp32 distributed optimizer's shard off the model parameters), the
round trip restores every byte and every view, so training continues bit-identically.

`released(chunks)` does the same for a model's weights: an engine that decodes with a copy of its own
(rollout/hybrid.py's generation copy, vLLM) releases the policy's training weights once the copy holds
them, and gets them back, byte for byte, before training needs them.

On CPU there is no device memory to free: by default the moves are no-ops (`device_type=None`). Tests
pass `device_type="cpu"` to run the same copy / free / restore path on CPU tensors.

`PhaseMemory` wraps the run's MetricsLogger: each timed phase `time/<phase>` also logs
`perf/peak_memory_gib/<phase>` (GPU: the allocator's peak within the phase; CPU: the process's peak
resident set so far, which never decreases). `perf/peak_memory_gib`, if logged, stays the run's peak.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, List, Optional

import torch

from megatron_rlhf.parallel import grad_buffer
from megatron_rlhf.parallel.cpu import peak_memory_gib


def _device_type() -> Optional[str]:
    return "cuda" if torch.cuda.is_available() else None


def _optimizers(optimizer) -> List:
    """The Megatron optimizers inside a (possibly chained) one."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def training_state_tensors(trainable) -> List[torch.Tensor]:
    """`trainable` (run.Trainable) -> DDP gradient buffers and optimizer tensors (may share storages)."""
    from megatron.core.utils import unwrap_model

    out: List[torch.Tensor] = []
    model_storages = set()
    for chunk in trainable.chunks:
        for p in unwrap_model(chunk).parameters():
            model_storages.add(p.untyped_storage().data_ptr())
        for buffer in grad_buffer.ddp_buffers(chunk):
            if buffer.grad_data is not None:
                out.append(buffer.grad_data)
            if getattr(buffer, "param_data", None) is not None:  # model weights: they stay
                model_storages.add(buffer.param_data.untyped_storage().data_ptr())
    for opt in _optimizers(trainable.optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                out.extend(t for t in (p, p.grad) if t is not None)
        for state in inner.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return [t for t in out if t.untyped_storage().data_ptr() not in model_storages]


def weight_tensors(chunks) -> List[torch.Tensor]:
    """The parameters of model `chunks` (DDP-wrapped or not); views of one DDP buffer share its storage."""
    from megatron.core.utils import unwrap_model

    return [p for c in chunks for p in unwrap_model(c).parameters()]


def _whole(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all bytes of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Storages of the given tensors on `device_type`, moved to host memory and back (module docstring)."""

    def __init__(self, tensors: Iterable[torch.Tensor], device_type: Optional[str]):
        self.device_type = device_type
        self.storages: Dict[int, torch.UntypedStorage] = {}
        if device_type is not None:
            for t in tensors:
                s = t.untyped_storage()
                if t.device.type == device_type and s.nbytes() > 0:
                    self.storages.setdefault(s.data_ptr(), s)
        self.host: List[torch.Tensor] = []
        self.sizes: List[int] = []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values()) if not self.host else sum(self.sizes)

    def offload(self) -> None:
        if self.host or not self.storages:
            return
        pin = self.device_type == "cuda"
        for s in self.storages.values():
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_whole(s), non_blocking=pin)
            self.host.append(host)
            self.sizes.append(s.nbytes())
        if pin:
            torch.cuda.synchronize()  # the copies must be done before the device memory is given back
        for s in self.storages.values():
            s.resize_(0)
        if pin:
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self.host:
            return
        pin = self.device_type == "cuda"
        for s, host, size in zip(self.storages.values(), self.host, self.sizes):
            s.resize_(size)
            _whole(s).copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        self.host, self.sizes = [], []


@contextlib.contextmanager
def host_offloaded(tensors: Iterable[torch.Tensor], device_type: Optional[str] = "auto") -> Iterator[HostOffload]:
    """The storages of `tensors` in host memory inside the block, restored byte for byte after it.

    device_type: "auto" -> "cuda" with CUDA, else None (a no-op); "cpu" exercises the moves on CPU (tests)."""
    moves = HostOffload(tensors, _device_type() if device_type == "auto" else device_type)
    moves.offload()
    try:
        yield moves
    finally:
        moves.reload()


def offloaded(trainables: Iterable, device_type: Optional[str] = "auto"):
    """Gradient buffers and optimizer state of `trainables` in host memory inside the block (`host_offloaded`).
    None entries are skipped (a critic-free run has no value model)."""
    return host_offloaded([t for tr in trainables if tr is not None for t in training_state_tensors(tr)], device_type)


def released(chunks, device_type: Optional[str] = "auto"):
    """The weights of model `chunks` in host memory inside the block (`host_offloaded`). Any use of them
    inside it fails loudly (their storages are empty), so a decode that still read them could not pass."""
    return host_offloaded(weight_tensors(chunks), device_type)


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class PhaseMemory:
    """A MetricsLogger whose `timer("time/<phase>")` also logs `perf/peak_memory_gib/<phase>`.

    Nested timers work: a phase's peak includes its inner phases' (the running peak is folded into
    every open phase before the allocator's peak counter is reset)."""

    def __init__(self, metrics):
        self._metrics = metrics
        self._open: List[List] = []  # [phase, peak so far]
        self._pending: Dict[str, float] = {}
        self._lifetime = 0.0  # the peak of the whole run: the resets below must not shrink perf/peak_memory_gib

    def __getattr__(self, name):
        return getattr(self._metrics, name)

    def _fold(self) -> None:
        now = peak_memory_gib()
        self._lifetime = max(self._lifetime, now)
        for entry in self._open:
            entry[1] = max(entry[1], now)

    @contextlib.contextmanager
    def timer(self, name: str, *args, **kwargs):
        phase = name.split("/", 1)[-1]
        self._fold()
        _reset_peak()
        self._open.append([phase, 0.0])
        try:
            with self._metrics.timer(name, *args, **kwargs) as handle:
                yield handle
        finally:
            self._fold()
            _, peak = self._open.pop()
            key = f"perf/peak_memory_gib/{phase}"
            self._pending[key] = max(self._pending.get(key, 0.0), peak)

    def log(self, step: int, scalars) -> None:
        merged = {**self._pending, **dict(scalars)}
        if "perf/peak_memory_gib" in merged:  # the run's peak, not the peak since the last phase began
            merged["perf/peak_memory_gib"] = max(float(merged["perf/peak_memory_gib"]), self._lifetime)
        self._pending = {}
        self._metrics.log(step, merged)
