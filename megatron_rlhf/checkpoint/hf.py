"""Hugging Face directory <-> Megatron distributed checkpoint (`torch_dist`), streaming.

Both directions go through `models/hf_mapping.py` and hold about one tensor (at most one decoder
layer's worth) in memory, whatever the model size:

- HF -> Megatron writes the DCP files `megatron.core.dist_checkpointing` reads, without building a
  model (`dcp_stream.write_dist_checkpoint`). The layout is the one Megatron itself saves (layers
  stacked under ``decoder.layers.<suffix>`` with a leading layer axis, TE-style keys, vocab
  unpadded, fc1 stored as ``[all gate; all up]``), so it loads at any TP/PP through
  `dist_checkpointing.load` with the target model's `sharded_state_dict`. Each chunk is read from
  safetensors and transformed only when the writer reaches it.
- Megatron -> HF reads one tensor slice at a time (`dcp_stream.DistCheckpointReader`) and streams
  it into safetensors shards whose headers are planned from the config (`hf_io.HFShardWriter`).

Next to the checkpoint, ``megatron_rlhf_meta.json`` records the model config (`ModelConfig.to_dict`),
the head, the original HF config, the source and the dtype; tokenizer files go to ``tokenizer/``.
Output is built in a temporary sibling directory and renamed into place when complete.

Also here: loading HF or converted checkpoints into a live (sharded) model, and saving a live model
as an HF directory. The command lines (`hf_to_megatron_main(argv)`, `megatron_to_hf_main(argv)`,
`main(argv)`) are in checkpoint/convert_cli.py.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_rlhf.checkpoint.dcp_stream import CkptChunk, DistCheckpointReader, write_dist_checkpoint
from megatron_rlhf.checkpoint.hf_checks import (
    check_source_dtype,
    check_tied_head,
    read_meta_fields,
    warn_remote_code,
)
from megatron_rlhf.checkpoint.hf_io import (
    HFCheckpoint,
    HFShardWriter,
    atomic_output_dir,
    copy_tokenizer_files,
    read_config_json,
)
from megatron_rlhf.checkpoint.out_dir import check_not_input, check_output_dir
from megatron_rlhf.models import hf_mapping as hm
from megatron_rlhf.models.hf_config import hf_config_for_export
from megatron_rlhf.models.hf_mapping import ConversionError
from megatron_rlhf.models.spec import ModelConfig, UnsupportedModelError, model_config_from_hf

META_FILE = "megatron_rlhf_meta.json"  # next to the checkpoint: what the model is and where it came from
TOKENIZER_DIR = "tokenizer"  # tokenizer files inside a converted checkpoint
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# HF -> Megatron
# --------------------------------------------------------------------------------------------


def validate_hf_tensors(ckpt: HFCheckpoint, cfg: ModelConfig, head: str) -> None:
    """Every expected tensor present with its shape, nothing unexpected (one line naming the first)."""
    expected = hm.expected_hf_shapes(cfg, head)
    present = set(ckpt.names())
    for name, shape in expected.items():
        if name not in present:
            raise ConversionError(f"missing tensor {name} in {ckpt.dir} (a {cfg.family} model with head={head} needs it)")
        hm.check_hf_shape(name, ckpt.shape(name), shape)
    allowed_extra = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints keep a copy
    check_tied_head(ckpt, cfg)  # ... but a copy that differs is refused, never dropped
    for name in ckpt.names():
        if name in expected or name in allowed_extra or any(p.fullmatch(name) for p in hm.IGNORED_HF):
            continue
        raise ConversionError(
            f"unexpected tensor {name} in {ckpt.dir}: not part of a {cfg.family} model with head={head}"
        )


def _extra_state_objects(cfg: ModelConfig, prefix: str = "") -> Dict[str, bytes]:
    """The per-layer `_extra_state` ShardedObjects Megatron expects, as it serialises them ([None])."""
    buf = io.BytesIO()
    torch.save([None], buf)
    n = cfg.num_layers
    return {
        f"{prefix}decoder.layers.{m}._extra_state/shard_{i}_{n}": buf.getvalue()
        for i in range(n)
        for m in hm.EXTRA_STATE_MODULES
    }


def checkpoint_chunks(
    cfg: ModelConfig,
    head: str,
    get_hf: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    prefix: str = "",
) -> List[CkptChunk]:
    """Describe every checkpoint chunk of the model; data comes from `get_hf` when written.

    One chunk per rule and layer, except fc1 whose gate and up halves are separate chunks (rows
    ``[0, F)`` and ``[F, 2F)``), which halves the memory of the largest transform.
    """
    out: List[CkptChunk] = []
    for rule, layer in hm.iter_entries(cfg, head):
        canon = hm.canonical_shape(rule, cfg)
        lead: Tuple[int, ...] = (layer,) if rule.per_layer else ()
        gshape = ((cfg.num_layers,) if rule.per_layer else ()) + canon
        one = (1,) if rule.per_layer else ()
        names = rule.hf_names(layer)
        if rule.kind == "gate_up":
            row = 0
            for name, shape in zip(names, hm.hf_shapes(rule, cfg)):
                offsets = lead + (row,) + (0,) * (len(canon) - 1)
                out.append(CkptChunk(prefix + rule.ckpt_key, gshape, offsets, one + shape, dtype, _getter(get_hf, name)))
                row += shape[0]
        else:
            offsets = lead + (0,) * len(canon)
            produce = (lambda r=rule, n=names: hm.to_canonical(r, [get_hf(x) for x in n], cfg))
            out.append(CkptChunk(prefix + rule.ckpt_key, gshape, offsets, one + canon, dtype, produce))
    return out


def _getter(get_hf, name):
    return lambda: get_hf(name)


@dataclass
class ConvertMeta:
    """What `megatron_rlhf_meta.json` holds."""

    model_config: dict
    head: str
    dtype: str
    source: str
    hf_config: Optional[dict] = None
    tokenizer_files: Tuple[str, ...] = ()
    key_prefix: str = ""
    format_version: int = 1

    def write(self, ckpt_dir: Path) -> None:
        data = dict(self.__dict__, tokenizer_files=list(self.tokenizer_files))
        (Path(ckpt_dir) / META_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, ckpt_dir: Path) -> "ConvertMeta":
        path = Path(ckpt_dir) / META_FILE
        if not path.is_file():
            raise ConversionError(
                f"no {META_FILE} in {ckpt_dir}: not written by convert_hf_to_megatron; for another checkpoint "
                "(e.g. from training) pass --hf-config HF_DIR (and --key-prefix NAME. if its keys have one)"
            )
        return cls(**read_meta_fields(path, cls))

    def config(self) -> ModelConfig:
        return ModelConfig(**self.model_config)


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    head: Optional[str] = None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    target_tp: Optional[int] = None,
    key_prefix: str = "",
    progress: bool = False,
    source: Optional[str] = None,
) -> Path:
    """Convert an HF directory into a Megatron distributed checkpoint at `out`; returns `out`.

    head: None keeps the source's (causal LM -> "lm", sequence classifier -> "scalar"); "scalar" on
    a causal LM seeds a reward/value model with a fresh (zero) head and drops `lm_head`.
    dtype: None keeps the config's dtype. target_tp: also check that this TP will split the weights.
    key_prefix: prepended to every checkpoint key (e.g. "policy." to match a model saved under that name).
    source: what to record as the origin (default `hf_dir`; the GGUF file when hf_dir was made from one).
    """
    out = Path(out)
    check_not_input(out, {"--hf-dir": Path(hf_dir)})
    check_output_dir(out, overwrite, "megatron")
    ckpt = HFCheckpoint(hf_dir)
    cfg, src_head = ckpt.model_config()
    check_source_dtype(ckpt, dtype)
    warn_remote_code(ckpt)
    dst_head = hm.normalize_head(head or src_head)
    if src_head == "scalar" and dst_head == "lm":
        raise ConversionError(
            f"{ckpt.config.get('architectures')} is a sequence classifier: it has no LM head to convert; use --head scalar"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    cfg.params_dtype = dtype or cfg.params_dtype
    if target_tp is not None:
        hm.check_tp(cfg, target_tp)
    validate_hf_tensors(ckpt, cfg, src_head)

    def get_hf(name: str) -> torch.Tensor:
        if name == "score.weight" and src_head == "lm":
            # Fresh reward/value head: zero, like ScalarHead's own init (predicts 0 before training).
            return torch.zeros(1, cfg.hidden_size)
        return ckpt.get(name)

    chunks = checkpoint_chunks(cfg, dst_head, get_hf, DTYPES[cfg.params_dtype], key_prefix)
    with atomic_output_dir(out, overwrite) as tmp:
        write_dist_checkpoint(tmp, chunks, _extra_state_objects(cfg, key_prefix), progress=progress)
        files = copy_tokenizer_files(ckpt.dir, tmp / TOKENIZER_DIR)
        ConvertMeta(
            model_config=cfg.to_dict(),
            head=dst_head,
            dtype=cfg.params_dtype,
            source=source or str(Path(hf_dir).absolute()),
            hf_config=ckpt.config,
            tokenizer_files=tuple(files),
            key_prefix=key_prefix,
        ).write(tmp)
    return out


# --------------------------------------------------------------------------------------------
# Megatron -> HF
# --------------------------------------------------------------------------------------------


def validate_dist_checkpoint(reader: DistCheckpointReader, cfg: ModelConfig, head: str, prefix: str = "") -> None:
    """Every tensor the model needs is in the checkpoint with its global shape (vocab may be padded)."""
    for rule in hm.rules_for(cfg, head):
        md = reader.tensor_meta(prefix + rule.ckpt_key)
        expected = ((cfg.num_layers,) if rule.per_layer else ()) + hm.canonical_shape(rule, cfg)
        found = tuple(md.size)
        ok = found == expected or (
            rule.kind == "vocab" and len(found) == 2 and found[1] == expected[1] and found[0] >= expected[0]
        )
        if not ok:
            raise ConversionError(
                f"shape mismatch for {prefix + rule.ckpt_key}: expected {expected}, found {found} in {reader.dir}"
            )


def iter_checkpoint_hf_tensors(
    reader: DistCheckpointReader, cfg: ModelConfig, head: str, prefix: str = ""
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(hf_name, tensor) in HF order, reading one Megatron tensor (one layer's slice) at a time.

    Memory: the slice, DCP's temporary copy of each saved chunk it overlaps, and the HF split.
    """
    for rule, layer in hm.iter_entries(cfg, head):
        canon = hm.canonical_shape(rule, cfg)
        lead = (layer,) if rule.per_layer else ()
        one = (1,) if rule.per_layer else ()
        key = prefix + rule.ckpt_key
        t = reader.read({key: (lead + (0,) * len(canon), one + canon)})[key].reshape(canon)
        yield from zip(rule.hf_names(layer), hm.from_canonical(rule, t, cfg))
        del t


def write_hf_dir(
    out_dir: Path,
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    head: str,
    dtype: torch.dtype,
    *,
    hf_config: Optional[dict] = None,
    tokenizer_dir: Optional[Path] = None,
    max_shard_bytes: int = 5 << 30,
    progress: bool = False,
) -> None:
    """Write config.json + sharded safetensors (+ tokenizer files) from a stream of HF tensors."""
    from tqdm import tqdm

    shapes = hm.expected_hf_shapes(cfg, head)
    writer = HFShardWriter(out_dir, [(n, s, dtype) for n, s in shapes.items()], max_shard_bytes)
    for name, t in tqdm(named_tensors, total=len(shapes), unit="tensor", desc="writing HF", disable=not progress):
        writer.write(name, t)
    writer.close()
    (out_dir / "config.json").write_text(
        json.dumps(hf_config_for_export(cfg, head, dtype, hf_config), indent=2, sort_keys=True) + "\n"
    )
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        copy_tokenizer_files(tokenizer_dir, out_dir)


def megatron_to_hf(
    megatron_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    dtype: Optional[str] = None,
    max_shard_bytes: int = 5 << 30,
    hf_config_dir: Optional[str | os.PathLike] = None,
    head: Optional[str] = None,
    key_prefix: Optional[str] = None,
    progress: bool = False,
) -> Path:
    """Convert a Megatron checkpoint into an HF directory.

    The model description comes from the checkpoint's megatron_rlhf_meta.json, or, for a checkpoint
    without one (e.g. a training checkpoint), from `hf_config_dir` (the HF directory the model came
    from: config.json and tokenizer files) with `head` and `key_prefix` (e.g. "policy.").
    """
    out = Path(out)
    hf_input = None if hf_config_dir is None else Path(hf_config_dir)
    check_not_input(out, {"--megatron-dir": Path(megatron_dir),
                          "--hf-config": hf_input if hf_input is None or hf_input.is_dir() else hf_input.parent})
    check_output_dir(out, overwrite, "hf")
    if max_shard_bytes <= 0:
        raise ConversionError(f"--max-shard-gb must be > 0 (got {max_shard_bytes / (1 << 30):g})")
    src = Path(megatron_dir)
    if hf_config_dir is not None:
        hf_dir = Path(hf_config_dir)
        cfg_file = hf_dir / "config.json" if hf_dir.is_dir() else hf_dir
        if not cfg_file.is_file():
            raise ConversionError(f"no config.json at {hf_config_dir}: --hf-config takes an HF directory or config.json")
        hf_config = read_config_json(cfg_file)
        try:
            cfg, src_head = model_config_from_hf(hf_config)
        except UnsupportedModelError as e:
            raise ConversionError(str(e)) from None
        meta = ConvertMeta(
            model_config=cfg.to_dict(),
            head=hm.normalize_head(head or src_head),
            dtype=cfg.params_dtype,
            source=str(cfg_file),
            hf_config=hf_config,
        )
        tokenizer_dir = cfg_file.parent
    else:
        meta = ConvertMeta.read(src)
        tokenizer_dir = src / TOKENIZER_DIR
        if head is not None and hm.normalize_head(head) != hm.normalize_head(meta.head):
            raise ConversionError(f"{src} holds a head={meta.head} model; --head {head} does not match it")
    if key_prefix is not None:
        meta.key_prefix = key_prefix
    cfg, head = meta.config(), hm.normalize_head(meta.head)
    reader = DistCheckpointReader(src)
    validate_dist_checkpoint(reader, cfg, head, meta.key_prefix)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out_dtype = DTYPES[dtype] if dtype else reader.tensor_meta(meta.key_prefix + hm.RULES[0].ckpt_key).properties.dtype
    with atomic_output_dir(out, overwrite) as tmp:
        write_hf_dir(
            tmp,
            iter_checkpoint_hf_tensors(reader, cfg, head, meta.key_prefix),
            cfg,
            head,
            out_dtype,
            hf_config=meta.hf_config,
            tokenizer_dir=tokenizer_dir,
            max_shard_bytes=max_shard_bytes,
            progress=progress,
        )
    return out


# --------------------------------------------------------------------------------------------
# Live (sharded) models
# --------------------------------------------------------------------------------------------


def load_hf_into_model(model_chunks, hf_dir: str | os.PathLike, head: Optional[str] = None) -> Tuple[ModelConfig, str]:
    """Load an HF directory straight into a sharded model (each rank reads its own slices)."""
    ckpt = HFCheckpoint(hf_dir)
    cfg, src_head = ckpt.model_config()
    head = hm.normalize_head(head or src_head)
    validate_hf_tensors(ckpt, cfg, src_head)
    hm.load_hf_weights(model_chunks, cfg, head, ckpt.get)
    return cfg, head


def load_megatron_into_model(model_chunks, ckpt_dir: str | os.PathLike) -> None:
    """`dist_checkpointing.load` with the chunks' own sharded_state_dict: resharding to any TP/PP."""
    from megatron.core import dist_checkpointing

    chunks = [hm._unwrap(c) for c in model_chunks]
    sharded = {f"chunk{i}": c.sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    for i, c in enumerate(chunks):
        c.load_state_dict(state[f"chunk{i}"], strict=True)


def save_hf_from_model(
    model_chunks,
    cfg: ModelConfig,
    head: str,
    out: str | os.PathLike,
    *,
    hf_config: Optional[dict] = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 << 30,
) -> None:
    """Collective: every rank streams the weights (`iter_hf_weights`); global rank 0 writes the HF dir."""
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    stream = hm.iter_hf_weights(model_chunks, cfg, head)
    if not rank0:
        for _ in stream:
            pass
        return
    dtype = next(iter(hm.named_global_parameters(model_chunks).values())).dtype
    with atomic_output_dir(Path(out), overwrite) as tmp:
        write_hf_dir(tmp, stream, cfg, head, dtype, hf_config=hf_config, max_shard_bytes=max_shard_bytes)
