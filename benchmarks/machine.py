"""What machine a benchmark ran on, for its JSON line: the VM's host CPU can differ between runs (an AMD EPYC
with AVX512-BF16 and no AMX on 2026-12-03, where bf16 figures had been explained by AMX before), and figures
from different CPUs do not compare."""

from __future__ import annotations

import argparse
import os
import platform
from typing import Iterable

# The instruction sets that decide how fast our fp32 and bf16 GEMMs and element-wise kernels run.
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu() -> dict:
    """{model, vendor, logical_cpus, flags: the FLAGS this CPU has}; from /proc/cpuinfo where there is one."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    break  # the first processor's block ends at its blank line
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "vendor": fields.get("vendor_id"),
        "logical_cpus": os.cpu_count(),
        "flags": [f for f in FLAGS if f in flags],
    }


def gpu():
    """The name of the GPU a benchmark ran on (the current CUDA device), or None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def sync():
    """Wait for the GPU's queued work (a no-op without CUDA), so that a wall-clock mark counts it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def refuse_emulated_dtypes(parser: argparse.ArgumentParser, dtypes: Iterable[str]) -> None:
    """Stop with one line (argparse's error) for a dtype whose matrix products torch runs in its reference
    kernel on this CPU (bf16 without AVX-512: parallel/cpu.py item 11): the timings would measure that
    kernel, ~100x slower than fp32, and not the code being benchmarked."""
    from megatron_rlhf.parallel.cpu import gemm_is_native

    for dtype in dtypes:
        if not gemm_is_native(dtype):
            flags = ", ".join(cpu()["flags"]) or "none of " + ", ".join(FLAGS)
            parser.error(f"--dtype {dtype}: this CPU ({flags}) has no native {dtype} matrix products, so torch "
                         f"would run its reference GEMM (parallel/cpu.py item 11); use --dtype float32 here")
