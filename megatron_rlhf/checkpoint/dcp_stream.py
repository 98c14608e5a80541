"""Megatron `torch_dist` checkpoints written and read one tensor chunk at a time.

The `torch_dist` format is PyTorch DCP (`.metadata` + `*.distcp`) plus Megatron's `metadata.json`
and `common.pt`. Megatron saves a model's weights as DCP tensors keyed by `ShardedTensor.key`
(layers stacked on a leading axis) and its `_extra_state` objects as DCP bytes entries. Any writer
that produces the same keys, global shapes and dtypes is loadable by `dist_checkpointing.load` at
any TP/PP, whatever its chunks: DCP reads the overlap of each requested slice with the saved chunks.

- `write_dist_checkpoint`: the save plan is built from chunk descriptions (`CkptChunk`); each
  chunk's data is produced only when the writer reaches it and is dropped right after.
- `DistCheckpointReader.read`: arbitrary slices of stored tensors, without loading whole tensors.

Both run in one process without a process group (DCP's `no_dist=True`).
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_rlhf.checkpoint.damage import root_cause
from megatron_rlhf.models.hf_mapping import ConversionError

Region = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes) inside a stored tensor


@dataclass
class CkptChunk:
    """One chunk of one checkpoint tensor; `produce()` returns its data only when it is written."""

    key: str
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


class _LazySavePlanner(DefaultSavePlanner):
    """A save plan made from chunk descriptions; tensor data is produced in `resolve_data`."""

    def __init__(self, chunks: Sequence[CkptChunk], objects: Dict[str, bytes], on_write: Callable[[], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks, self._objects, self._on_write = chunks, objects, on_write
        self._by_index = {(c.key, tuple(c.offsets)): c for c in chunks}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self._objects]
        for c in self._chunks:
            items.append(
                WriteItem(
                    index=MetadataIndex(c.key, torch.Size(c.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                        properties=TensorProperties(dtype=c.dtype),
                        size=torch.Size(c.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        c = self._by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = c.produce().to(c.dtype).reshape(c.sizes)
        self._on_write()
        return t


class _StreamingWriter(FileSystemWriter):
    """FileSystemWriter that writes items one by one and keeps none of them.

    (The stock writer keeps a reference to the last chunk of every key until its file is done,
    which would hold a layer's worth of every stacked tensor.) A new file starts past
    `max_file_bytes`, so loads can read files in parallel.
    """

    def __init__(self, path: Path, max_file_bytes: int):
        super().__init__(str(path), single_file_per_rank=True, thread_count=1, sync_files=False)
        self._dir, self._max_file_bytes = Path(path), max_file_bytes

    def write_data(self, plan, planner):
        prefix = plan.storage_data.prefix
        results, file_idx, stream, name = [], 0, None, ""
        # Objects first (tiny), then tensors in plan order: layer by layer.
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        try:
            for item in items:
                if stream is None or stream.tell() > self._max_file_bytes:
                    if stream is not None:
                        stream.close()
                    name = f"{prefix}{file_idx}.distcp"
                    file_idx += 1
                    stream = open(self._dir / name, "wb")
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    data = data.detach().cpu().contiguous()
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # torch.save would write the whole base storage of a view
                    torch.save(data, stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)))
                del data
        finally:
            if stream is not None:
                stream.close()
        fut: Future = Future()
        fut.set_result(results)
        return fut


@contextlib.contextmanager
def _single_process_dcp():
    """DCP in this one process: quiet its single-process warning, re-raise its wrapped errors as themselves.

    (DCP wraps any error of the writer/reader, e.g. a ConversionError from a chunk producer, in a
    CheckpointException, a BaseException that `except Exception` does not catch.)
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            failures = list(e.failures.values())
            if failures and isinstance(failures[0], tuple) and isinstance(failures[0][0], BaseException):
                raise failures[0][0] from None
            raise


def write_dist_checkpoint(
    out_dir: Path,
    chunks: Sequence[CkptChunk],
    objects: Dict[str, bytes],
    *,
    progress: bool = False,
    max_file_bytes: int = 4 << 30,
) -> None:
    """Write a Megatron `torch_dist` checkpoint from chunk descriptions, one chunk in memory at a time.

    objects: DCP bytes entries (Megatron's ShardedObjects, already serialised), by unique key.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from tqdm import tqdm

    bar = tqdm(total=len(chunks), unit="tensor", desc="writing megatron checkpoint", disable=not progress)
    planner = _LazySavePlanner(chunks, objects, lambda: bar.update(1))
    with _single_process_dcp():
        dcp.save({}, storage_writer=_StreamingWriter(out_dir, max_file_bytes), planner=planner, no_dist=True)
    bar.close()
    torch.save({}, out_dir / "common.pt")  # Megatron's non-sharded state: a GPTModel has none
    save_config(CheckpointingConfig("torch_dist", 1), str(out_dir))  # metadata.json: says "torch_dist"


class _SlicePlanner(DefaultLoadPlanner):
    """Loads the region (offsets, sizes) of each requested stored tensor into the state-dict tensor."""

    def __init__(self, requests: Dict[str, Region]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._requests = requests

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn in self.state_dict:
            offsets, sizes = self._requests[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        # dest_offsets are relative to the requested region, i.e. to the state-dict tensor.
        t = self.state_dict[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t


class _CachedReader(FileSystemReader):
    """Reads `.metadata` once, not once per slice."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class DistCheckpointReader:
    """Reads slices of tensors from a `torch_dist` checkpoint without loading whole tensors.

    Works on any checkpoint with the Megatron layout, whatever TP/PP saved it.
    Memory per read: the slice plus DCP's temporary copy of each saved chunk it overlaps.
    """

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = Path(ckpt_dir)
        if not (self.dir / ".metadata").is_file():
            raise ConversionError(f"{self.dir} is not a torch_dist checkpoint (no .metadata file)")
        self._reader = _CachedReader(self.dir)
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - truncated or garbage: one line, not a pickle traceback
            raise ConversionError(f"{self.dir / '.metadata'} is unreadable ({root_cause(e)}): the checkpoint is "
                                  "damaged; copy it again or use another one") from None
        self._check_files()

    def _check_files(self) -> None:
        """Every `.distcp` file `.metadata` names exists and is long enough (checked before any output)."""
        need: Dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(need.items()):
            path = self.dir / name
            if not path.is_file():
                raise ConversionError(f"checkpoint {self.dir} is damaged: {name} is missing (.metadata names it); "
                                      "copy the checkpoint again or use another one")
            if path.stat().st_size < size:
                raise ConversionError(f"checkpoint {self.dir} is damaged: {name} is truncated ({path.stat().st_size} "
                                      f"of {size} bytes); copy the checkpoint again or use another one")

    def tensor_meta(self, key: str):
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise ConversionError(f"missing tensor {key} in checkpoint {self.dir}")
        return md

    def read(self, requests: Dict[str, Region]) -> Dict[str, torch.Tensor]:
        """{key: (offsets, sizes)} -> {key: tensor of `sizes`} in the checkpoint's dtype."""
        out = {k: torch.empty(sizes, dtype=self.tensor_meta(k).properties.dtype) for k, (_, sizes) in requests.items()}
        try:
            with _single_process_dcp():
                dcp.load(out, storage_reader=self._reader, planner=_SlicePlanner(requests), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - corrupt data behind an intact size
            raise ConversionError(f"checkpoint {self.dir} is damaged: reading {', '.join(requests)} failed "
                                  f"({root_cause(e)}); copy the checkpoint again or use another one") from None
        return out
