"""File formats for HF conversion: lazy HF directory reader, streaming safetensors writer, atomic output.

- `HFCheckpoint`: config.json + tensors by name, read one at a time (safetensors single or sharded
  with an index; legacy `.bin` only through `torch.load(weights_only=True)`; never remote code).
- `HFShardWriter`: sharded safetensors whose headers are planned from known shapes, so tensors
  stream to disk as they are produced (memory holds one tensor, not one shard).
- `atomic_output_dir`: build output in a temporary sibling directory, rename when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.checkpoint.out_dir import check_output_dir, sweep_stale_tmp, tmp_prefix
from megatron_rlhf.models import hf_mapping as hm
from megatron_rlhf.models.hf_mapping import ConversionError
from megatron_rlhf.models.spec import ModelConfig, UnsupportedModelError, model_config_from_hf

# Files that travel with a model but are not weights (tokenizer, chat template, generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
_ST_DTYPES_REV = {v: k for k, v in _ST_DTYPES.items()}


@contextlib.contextmanager
def atomic_output_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp dir next to `out`; on success it becomes `out` (replacing it if `overwrite`).

    A failed conversion leaves nothing (the temp dir is removed); a killed one leaves only a hidden
    `.<name>.tmp-<pid>@<host>-*` directory, so `out` never exists half-written; the next conversion
    into `out` removes it (out_dir.sweep_stale_tmp).
    """
    out = Path(out).absolute()
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_tmp(out)
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(out), dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should be an ordinary directory
    try:
        yield tmp
        if out.exists():  # overwrite: move the old one aside first so a failure here loses nothing
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "x")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer_files(src: Path, dst: Path) -> List[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


class HFCheckpoint:
    """An HF model directory: config.json plus tensors read one at a time.

    Weights: ``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``, or
    (legacy) ``pytorch_model.bin[.index.json]`` read only with ``torch.load(weights_only=True)``.
    No model code is ever imported from the directory (no trust_remote_code).
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            what = "is a file, not a directory" if self.dir.exists() else "does not exist"
            raise ConversionError(f"--hf-dir {self.dir} {what}: pass a Hugging Face model directory")
        self.config = read_config_json(self.dir / "config.json")
        self._file_of: Dict[str, Path] = {}
        self._meta: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._bin_cache: Tuple[Optional[Path], Optional[dict]] = (None, None)
        st_index, bin_index = self.dir / "model.safetensors.index.json", self.dir / "pytorch_model.bin.index.json"
        st_files = sorted(self.dir.glob("*.safetensors"))
        if st_index.is_file():
            self._index(st_index)
        elif st_files:
            for f in st_files:
                self._scan_safetensors(f)
        elif bin_index.is_file():
            self._index(bin_index)
        elif (self.dir / "pytorch_model.bin").is_file():
            self._scan_bin(self.dir / "pytorch_model.bin")
        else:
            raise ConversionError(
                f"no weights in {self.dir}: expected model.safetensors, model.safetensors.index.json, "
                "pytorch_model.bin or pytorch_model.bin.index.json"
            )

    def _index(self, index_path: Path) -> None:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        for f in sorted({self.dir / v for v in weight_map.values()}):
            if not f.is_file():
                raise ConversionError(f"{index_path.name} names {f.name}, which is missing from {self.dir}")
            (self._scan_safetensors if f.suffix == ".safetensors" else self._scan_bin)(f)

    def _scan_safetensors(self, path: Path) -> None:
        with _open_safetensors(path) as f:  # header only: no tensor data is read
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = _ST_DTYPES_REV.get(sl.get_dtype())
                if dtype is None:
                    kind = " (float8: a quantized checkpoint)" if sl.get_dtype().startswith("F8") else ""
                    raise ConversionError(f"tensor {name} in {path.name} has unsupported dtype {sl.get_dtype()}{kind}: "
                                          "only float32/bfloat16/float16 (float64 with --dtype) weights convert")
                self._add(name, path, tuple(sl.get_shape()), dtype)

    def _scan_bin(self, path: Path) -> None:
        for name, t in self._load_bin(path).items():
            self._add(name, path, tuple(t.shape), t.dtype)

    def _add(self, name: str, path: Path, shape, dtype) -> None:
        if name in self._file_of:
            raise ConversionError(f"tensor {name} appears twice in {self.dir} ({self._file_of[name].name}, {path.name})")
        self._file_of[name] = path
        self._meta[name] = (shape, dtype)

    def _load_bin(self, path: Path) -> dict:
        # One .bin file at a time, memory-mapped where the file format allows it.
        if self._bin_cache[0] != path:
            self._bin_cache = (None, None)
            try:
                try:
                    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                    sd = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                from megatron_rlhf.checkpoint.hf_checks import disallowed_pickle_globals

                raise ConversionError(
                    f"{path} does not load with torch.load(weights_only=True): it needs "
                    f"{disallowed_pickle_globals(path, str(e))}, which is not a tensor type; it is refused rather "
                    "than executed - convert it to safetensors with code you trust"
                ) from None
            except (RuntimeError, EOFError, OSError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
                raise ConversionError(f"{path} is not a readable torch file ({first[:120]}): it is truncated or "
                                      "damaged; download or copy it again") from None
            self._bin_cache = (path, sd)
        return self._bin_cache[1]  # type: ignore[return-value]

    def names(self) -> List[str]:
        return list(self._file_of)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor. Safetensors files are opened per tensor, so no mapping outlives it."""
        if name not in self._file_of:
            raise ConversionError(f"missing tensor {name} in {self.dir}")
        path = self._file_of[name]
        if path.suffix == ".safetensors":
            with _open_safetensors(path) as f:
                return f.get_tensor(name)
        return self._load_bin(path)[name].clone()

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor, reading only those rows from safetensors."""
        path = self._file_of[name]
        if path.suffix == ".safetensors":
            with _open_safetensors(path) as f:
                return f.get_slice(name)[start:stop]
        return self._load_bin(path)[name][start:stop]

    def model_config(self) -> Tuple[ModelConfig, str]:
        try:
            cfg, head = model_config_from_hf(self.config)
        except UnsupportedModelError as e:
            raise ConversionError(str(e)) from None
        except KeyError as e:
            raise ConversionError(f"config.json in {self.dir} lacks {e.args[0]!r}") from None
        return cfg, hm.normalize_head(head)


def read_config_json(path: Path) -> dict:
    """An HF config.json as a dict; ConversionError for a missing, invalid or non-object file."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"no config.json in {path.parent}: --hf-dir must be a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}): fix or replace it") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a JSON {type(config).__name__}, not an object of model settings: "
                              "fix or replace it")
    return config


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """safe_open that turns a truncated or garbage file into one ConversionError line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ConversionError(f"{path} is not a readable safetensors file ({e}): it is truncated or damaged; "
                              "download or copy it again") from None


class HFShardWriter:
    """Writes sharded safetensors whose headers are planned up front from (name, shape, dtype).

    Because every shape is known from the config before any data exists, each shard's header is
    written first and tensors are appended as they arrive: memory holds one tensor, not a shard.
    Tensors must arrive in the planned order.
    """

    def __init__(self, out_dir: Path, planned: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        shards: List[List[Tuple[str, Tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for entry in planned:
            nbytes = _nbytes(entry[1], entry[2])
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = shards
        self.total = sum(_nbytes(s, d) for _, s, d in planned)
        self._order = [(f, e) for f, shard in zip(self.files, shards) for e in shard]
        self._pos = 0
        self._stream = None
        self._file: Optional[str] = None

    def _open(self, file: str) -> None:
        if self._stream is not None:
            self._stream.close()
        entries = self.shards[self.files.index(file)]
        header, offset = {}, 0
        for name, shape, dtype in entries:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._stream = open(self.out_dir / file, "wb")
        self._stream.write(struct.pack("<Q", len(raw)))
        self._stream.write(raw)
        self._file = file

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._order):
            raise ConversionError(f"unexpected tensor {name}: all planned tensors are already written")
        file, (exp_name, shape, dtype) = self._order[self._pos]
        if name != exp_name:
            raise ConversionError(f"tensor order: expected {exp_name}, got {name}")
        hm.check_hf_shape(name, tensor.shape, shape)
        if file != self._file:
            self._open(file)
        t = tensor.detach().to("cpu", dtype).contiguous()
        self._stream.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._pos += 1

    def close(self) -> None:
        if self._pos != len(self._order):
            missing = self._order[self._pos][1][0]
            raise ConversionError(f"missing tensor {missing}: the stream ended early")
        if self._stream is not None:
            self._stream.close()
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {name: f for f, shard in zip(self.files, self.shards) for name, _, _ in shard},
            }
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()

