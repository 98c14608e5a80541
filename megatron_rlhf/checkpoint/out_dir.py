"""Where conversion output may go: never onto its own input, `--overwrite` only over our own output,
and temporary directories that a killed conversion left behind are removed (ours) or named.

A conversion builds its output in a hidden sibling `.<out>.tmp-<pid>@<host>-<random>` and renames it
into place when complete (`hf_io.atomic_output_dir`); the pid and host in the name tell a later run
whether the conversion that made it is still alive.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Dict, Optional

from megatron_rlhf.models.hf_mapping import ConversionError

MEGATRON_MARKER = "megatron_rlhf_meta.json"  # in every hf-to-megatron output (checkpoint/hf.py META_FILE)


def check_not_input(out: Path, inputs: Dict[str, Optional[Path]]) -> None:
    """--out may not be, be inside, or contain an input directory (whatever --overwrite says)."""
    o = Path(out).resolve()
    for flag, path in inputs.items():
        if path is None:
            continue
        i = Path(path).resolve()
        if o == i:
            rel = f"is the same directory as {flag}"
        elif i in o.parents:
            rel = f"is inside {flag} {path}"
        elif o in i.parents:
            rel = f"contains {flag} {path}"
        else:
            continue
        raise ConversionError(f"--out {out} {rel}: writing there would destroy the input; choose another --out")


def looks_like_ours(out: Path, kind: str) -> bool:
    """Whether existing `out` is what a conversion of `kind` ("megatron" | "hf") writes (or is empty)."""
    names = set(os.listdir(out))
    if not names:
        return True
    if kind == "megatron":
        return MEGATRON_MARKER in names
    weights = any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names
    return "config.json" in names and weights


def check_output_dir(out: Path, overwrite: bool, kind: Optional[str] = None) -> None:
    """An existing `out` needs --overwrite, and --overwrite replaces only a directory we wrote."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ConversionError(f"output directory {out} already exists: pass --overwrite or choose another --out")
    if not out.is_dir() or out.is_symlink():
        raise ConversionError(f"--out {out} is not a directory: --overwrite replaces only a converter output")
    if kind is not None and not looks_like_ours(out, kind):
        what = f"no {MEGATRON_MARKER}" if kind == "megatron" else "no config.json with safetensors weights"
        raise ConversionError(
            f"--out {out} does not look like a converter output ({what}): --overwrite will not replace it; "
            "remove it yourself or choose another --out"
        )


def tmp_prefix(out: Path) -> str:
    return f".{Path(out).name}.tmp-{os.getpid()}@{socket.gethostname()}-"


def _owner(name: str, out_name: str):
    """(pid, host) from a temp directory name, None for names without them (older versions)."""
    rest = name[len(f".{out_name}.tmp-"):]
    if "@" not in rest or "-" not in rest:
        return None
    owner, _, _ = rest.rpartition("-")
    pid, _, host = owner.partition("@")
    return (int(pid), host) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_tmp(out: Path, log=None) -> None:
    """Remove `.<out>.tmp-*` directories of dead conversions on this host; name any other leftover."""
    out = Path(out)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if not out.parent.is_dir():
        return
    host = socket.gethostname()
    for p in sorted(out.parent.iterdir()):
        if not p.name.startswith((f".{out.name}.tmp-", f".{out.name}.old-")) or not p.is_dir():
            continue
        owner = _owner(p.name, out.name) if ".tmp-" in p.name else None
        if owner is not None and owner[1] == host and not _alive(owner[0]):
            shutil.rmtree(p, ignore_errors=True)
            log(f"removed {p}: left by a conversion (pid {owner[0]}) that was killed")
        elif owner is not None and owner[1] == host and owner[0] != os.getpid():
            log(f"warning: {p} belongs to a conversion still running (pid {owner[0]}) into the same --out")
        elif owner is None:
            log(f"warning: {p} was left by an interrupted conversion: remove it if no conversion is running")
        elif owner[1] != host:
            log(f"warning: {p} was left by a conversion on host {owner[1]}: remove it if that one has ended")
