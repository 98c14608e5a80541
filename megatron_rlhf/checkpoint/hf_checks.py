"""Input checks of HF <-> Megatron conversion that go beyond names and shapes (checkpoint/hf.py).

Each function raises `ConversionError` with one line naming the culprit and the fix, or returns
quietly; nothing here writes output.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import torch

from megatron_rlhf.models.hf_mapping import ConversionError
from megatron_rlhf.models.spec import ModelConfig

_ROWS_PER_BLOCK = 4096  # compare embedding-sized tensors a block of rows at a time (bounded memory)


def check_tied_head(ckpt, cfg: ModelConfig) -> None:
    """Tied embeddings with a stored `lm_head.weight` that differs from the embedding are refused.

    Some tied checkpoints keep a copy of the embedding as `lm_head.weight` (harmless: it is not
    converted). A copy that differs means the config and the weights disagree about the head, and
    converting either way would silently drop a tensor.
    """
    name, emb = "lm_head.weight", "model.embed_tokens.weight"
    if not cfg.tie_embeddings or name not in ckpt.names() or emb not in ckpt.names():
        return
    rows = ckpt.shape(emb)[0]
    same = ckpt.shape(name) == ckpt.shape(emb)
    for start in range(0, rows, _ROWS_PER_BLOCK):
        if not same:
            break
        stop = min(rows, start + _ROWS_PER_BLOCK)
        same = torch.equal(ckpt.get_rows(name, start, stop), ckpt.get_rows(emb, start, stop))
    if not same:
        raise ConversionError(
            f"config.json in {ckpt.dir} has tie_word_embeddings=true but {name} differs from {emb}: "
            f"set tie_word_embeddings=false to keep the stored head, or delete {name} to tie it to the embedding"
        )


def read_meta_fields(path, cls) -> dict:
    """The fields of `megatron_rlhf_meta.json` at `path` that dataclass `cls` knows, as keyword arguments.

    Fields written by a newer version are ignored with a warning (a newer writer must not break an
    older reader); a file that is not a JSON object is a ConversionError.
    """
    import dataclasses
    import json

    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}): convert the checkpoint again, or pass "
                              "--hf-config HF_DIR to describe it without this file") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object: convert the checkpoint again")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        print(f"warning: {path} has fields this version does not know, ignored: {', '.join(unknown)}",
              file=sys.stderr)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise ConversionError(f"{path} lacks {', '.join(missing)}: convert the checkpoint again")
    kwargs = {k: v for k, v in data.items() if k in known}
    kwargs["tokenizer_files"] = tuple(kwargs.get("tokenizer_files", ()))
    return kwargs


_TRAINING_DTYPES = ("float32", "bfloat16", "float16")


def check_source_dtype(ckpt, requested: Optional[str]) -> None:
    """A source that is not float32/bfloat16/float16 is reported, never silently cast.

    float64 converts only with an explicit --dtype; float8 and other quantized checkpoints need
    their scales, which this converter does not apply, so they are refused.
    """
    cfg = ckpt.config
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(cfg["quantization_config"], dict) else "?"
        raise ConversionError(f"config.json in {ckpt.dir} describes a quantized checkpoint (quant_method={method}): "
                              "only unquantized float32/bfloat16/float16 weights convert")
    declared = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
    tensor_dtypes = sorted({str(ckpt.dtype(n)).replace("torch.", "") for n in ckpt.names()})
    odd = [d for d in [declared, *tensor_dtypes] if d not in _TRAINING_DTYPES]
    if not odd:
        return
    if any("float8" in d or d.startswith(("int", "uint")) for d in odd):
        raise ConversionError(f"{ckpt.dir} holds {odd[0]} weights (config dtype {declared}, tensors "
                              f"{', '.join(tensor_dtypes)}): quantized checkpoints do not convert; use a "
                              "bfloat16/float32 checkpoint")
    if requested is None:
        raise ConversionError(f"{ckpt.dir} holds {odd[0]} weights (config dtype {declared}, tensors "
                              f"{', '.join(tensor_dtypes)}), which training does not use: pass --dtype float32 "
                              "(or bfloat16/float16) to convert them to that dtype")


def warn_remote_code(ckpt) -> None:
    """`auto_map` names remote code; a supported architecture converts without it: say so."""
    auto_map = ckpt.config.get("auto_map")
    if auto_map:
        arch = (ckpt.config.get("architectures") or [ckpt.config.get("model_type")])[0]
        print(f"warning: config.json in {ckpt.dir} has auto_map ({', '.join(sorted(auto_map))}): that remote code "
              f"is ignored; the weights are converted as the built-in {arch}", file=sys.stderr)


def pickle_globals(path) -> List[str]:
    """Every `module.name` global a pickle (or torch zip file's data.pkl) would import; nothing is run."""
    import io
    import pickletools
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            raw = z.read(pkl) if pkl else b""
    else:
        raw = open(path, "rb").read()
    found, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(raw)):
            if op.name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            if isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - a truncated stream: report what was found before it
        pass
    return list(dict.fromkeys(found))


def disallowed_pickle_globals(path, message: str) -> str:
    """The globals that make torch.load(weights_only=True) refuse `path`, in full (for the error line)."""
    import re

    named = re.findall(r"GLOBAL ([\w.]+)", message)
    if named:
        return ", ".join(dict.fromkeys(named))
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except Exception:  # noqa: BLE001 - private API: fall back to "torch.* is fine"
        allowed = set()
    bad = [g for g in pickle_globals(path) if g not in allowed and not g.startswith("torch.")]
    return ", ".join(bad) or "objects that are not tensors"
