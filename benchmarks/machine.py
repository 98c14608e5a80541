"""What machine a benchmark ran on, for its JSON line: the VM's host CPU can differ between runs (an AMD EPYC
with AVX512-BF16 and no AMX on 2026-12-03, where bf16 figures had been explained by AMX before), and figures
from different CPUs do not compare."""

from __future__ import annotations

import os
import platform

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
