"""Input checks of HF <-> Megatron conversion that go beyond names and shapes (checkpoint/hf.py).

Each function raises `ConversionError` with one line naming the culprit and the fix, or returns
quietly; nothing here writes output.
"""

from __future__ import annotations

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
    import sys

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
