"""Run monitoring on rank 0: TensorBoard scalars, a jsonl copy, a progress bar and phase timers.

::

    metrics = MetricsLogger(run_dir, enabled=rank == 0, total_steps=1000, config_text=yaml)
    metrics.start(step)            # optional: the step a resumed run starts from (default 0)
    with metrics.timer("time/forward_backward"):
        ...
    metrics.log(step, {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tps})
    metrics.close()

Scalar names are ``<namespace>/<name>`` with a namespace from `namespaces` (train/, eval/, time/, perf/
by default; later stages pass their own). Every method is a no-op when ``enabled`` is False, so all
ranks can call it unconditionally. Files in ``run_dir``: ``tensorboard/`` (event files) and
``metrics.jsonl`` (one JSON object per `log` call: step, wall_time and the scalars).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

NAMESPACES = ("train", "eval", "time", "perf")
POSTFIX_KEYS = ("train/loss", "train/accuracy", "train/lr", "eval/loss", "eval/accuracy")


class _Timing:
    """Handle yielded by `MetricsLogger.timer`; `seconds` is set when the block ends."""

    seconds: float = 0.0


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a scalar metric must have one element, got shape {tuple(value.shape)}")
        return float(value.detach().float().cpu())
    return float(value)


class MetricsLogger:
    """Rank-0 metrics sink; see the module docstring."""

    def __init__(
        self,
        run_dir: str,
        enabled: bool = True,
        total_steps: Optional[int] = None,
        start_step: int = 0,
        *,
        tensorboard: bool = True,
        progress_bar: bool = True,
        config_text: Optional[str] = None,
        namespaces: Sequence[str] = NAMESPACES,
        desc: str = "train",
        log_interval: int = 1,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self.log_interval = max(1, int(log_interval))
        self.namespaces = tuple(namespaces)
        self._settings = dict(
            total_steps=total_steps, tensorboard=tensorboard, progress_bar=progress_bar, config_text=config_text, desc=desc
        )
        self._writer = None
        self._bar = None
        self._jsonl = None
        self._opened = False
        self._timers: Dict[str, float] = {}
        self._last_step = start_step
        if enabled and start_step > 0:
            self.start(start_step)

    def start(self, step: int = 0) -> None:
        """Open the outputs at `step` (the step a resumed run starts from); `log` opens them at the
        constructor's `start_step` otherwise. Calling it again has no effect."""
        if not self.enabled or self._opened:
            return
        self._opened = True
        self._last_step = step
        s = self._settings
        os.makedirs(self.run_dir, exist_ok=True)
        if s["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote after the step we resume from (TensorBoard
            # hides steps >= purge_step from older files), so curves do not fold back on themselves.
            self._writer = SummaryWriter(
                log_dir=os.path.join(self.run_dir, "tensorboard"), purge_step=step + 1 if step > 0 else None
            )
        # Append: a resumed run continues the same file (readers keep the last row per step).
        self._jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1)
        if s["progress_bar"]:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=s["total_steps"], initial=step, desc=s["desc"], dynamic_ncols=True, unit="step")
        if s["config_text"] is not None:
            self.log_text("config", s["config_text"], step=step)

    # ----------------------------------------------------------------------------------------
    def _check(self, key: str) -> None:
        ns, sep, name = key.partition("/")
        if not sep or not name or ns not in self.namespaces:
            raise ValueError(f"metric name {key!r} must be '<namespace>/<name>' with a namespace in {self.namespaces}")

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Write `scalars` (floats, ints or one-element tensors) at `step`, plus the pending timers
        (seconds per step, averaged over the steps since the previous `log`). Moves the bar to `step`."""
        if not self.enabled:
            return
        self.start(self._last_step)
        values: Dict[str, float] = {}
        for key, value in scalars.items():
            self._check(key)
            if value is not None:
                values[key] = _as_float(value)
        steps = max(1, step - self._last_step)
        for key, seconds in self._timers.items():
            values.setdefault(key, seconds / steps)
        self._timers.clear()
        self._last_step = step
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=step)
        record = {"step": step, "wall_time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self.progress(step, values)

    def log_step(self, step: int, scalars: Mapping[str, Any], last: bool = False) -> bool:
        """`log` every `log_interval` steps (and at the `last` step); otherwise only move the bar.

        Timers keep accumulating in between, so `time/*` is the mean over the interval. Returns
        whether the scalars were written."""
        if step % self.log_interval == 0 or last:
            self.log(step, scalars)
            return True
        self.progress(step)
        return False

    def progress(self, step: int, values: Optional[Mapping[str, float]] = None) -> None:
        """Move the progress bar to `step` (call every step if logging is sparser)."""
        if self._bar is None:
            return
        if values:  # before the move: the move redraws the bar, with this step's values
            shown = {k.split("/", 1)[1] if k.startswith("train/") else k: v for k, v in values.items() if k in POSTFIX_KEYS}
            if shown:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items() if not math.isnan(v)}, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        elif values:
            self._bar.refresh()

    @contextmanager
    def timer(self, name: str, cuda_sync: bool = True) -> Iterator[_Timing]:
        """Time a phase; the seconds accumulate under `name` until the next `log`. With CUDA the device
        is synchronised on both ends so the time covers the kernels, not just their launch."""
        handle = _Timing()
        if not self.enabled:
            yield handle
            return
        self._check(name)
        sync = cuda_sync and torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield handle
        finally:
            if sync:
                torch.cuda.synchronize()
            handle.seconds = time.perf_counter() - start
            self._timers[name] = self._timers.get(name, 0.0) + handle.seconds

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        """Text in TensorBoard's text tab (shown as a preformatted block)."""
        if not self.enabled:
            return
        self.start(self._last_step)
        if self._writer is not None:
            self._writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()), global_step=step)

    def write(self, message: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str, skip_bad: bool = False) -> List[Dict[str, Any]]:
    """The rows of a metrics.jsonl file (for scripts and tests). `skip_bad`: leave out lines that are not JSON
    (the last line of a run killed mid-write, or one being written now) instead of raising."""
    rows = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                if not skip_bad:
                    raise
    return rows
