"""Reading raw rows from local files (jsonl, json, parquet, arrow, or a saved `datasets` directory), before any
tokenising (data/dataset.py)."""

from __future__ import annotations

import glob as globlib
import json
import os
from typing import List, Optional, Sequence

from megatron_rlhf.data.tokenizer import DataError

FORMATS = ("jsonl", "json", "parquet", "arrow")
_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
JSON_COLUMN = "_json"  # json/jsonl rows are read as raw text lines and parsed per row (see read_rows)




def resolve_files(path: str) -> List[str]:
    """A file, a glob, or a directory (its supported files, sorted) -> list of files."""
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return [path]
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path) if os.path.splitext(f)[1] in _EXTENSIONS
        )
    elif os.path.isfile(path):
        files = [path]
    else:
        files = sorted(f for f in globlib.glob(path) if os.path.isfile(f) or _is_saved_dataset(f))
    if not files:
        raise DataError(f"no data files at '{path}': give a jsonl/json/parquet/arrow file, glob or directory")
    return files


def _is_saved_dataset(path: str) -> bool:
    """A directory written by `Dataset.save_to_disk`."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def detect_format(files: Sequence[str], fmt: Optional[str] = None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise DataError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
        return fmt
    if _is_saved_dataset(files[0]):
        return "arrow"
    kinds = {_EXTENSIONS.get(os.path.splitext(f)[1]) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise DataError(
            f"cannot tell the format of {files[0]!r}{' and others' if len(files) > 1 else ''} from the "
            f"extension: set data.format to one of {', '.join(FORMATS)}"
        )
    return kinds.pop()


def read_rows(path: str, fmt: Optional[str] = None):
    """Raw rows as a `datasets.Dataset`. Local files only.

    json/jsonl are read line by line (`Dataset.from_text`) and parsed per row during tokenisation, so
    a row with a wrongly typed field or broken JSON is one bad row, not a failed load (Arrow's JSON
    reader rejects a whole file whose columns change type). A .json file holding one JSON array is
    split into its elements.
    """
    import datasets

    datasets.disable_progress_bars()
    files = resolve_files(path)
    fmt = detect_format(files, fmt)
    if fmt in ("jsonl", "json"):
        texts: List[str] = []
        line_files = []
        for f in files:
            with open(f, encoding="utf-8") as fh:
                head = fh.read(4096).lstrip()
            if head.startswith("["):
                try:
                    with open(f, encoding="utf-8") as fh:
                        items = json.load(fh)
                except json.JSONDecodeError as e:
                    raise DataError(f"'{f}' is not valid JSON ({e}): fix the file or write it as jsonl") from None
                texts.extend(json.dumps(x) for x in items)
            else:
                line_files.append(f)
        parts = []
        line_files = [f for f in line_files if os.path.getsize(f) > 0]  # datasets cannot read an empty file
        if line_files:
            ds = datasets.Dataset.from_text(line_files, keep_in_memory=True)
            ds = ds.filter(lambda t: bool(t.strip()), input_columns="text", keep_in_memory=True)
            parts.append(ds.rename_column("text", JSON_COLUMN))
        if texts:
            parts.append(datasets.Dataset.from_dict({JSON_COLUMN: texts}))
        if not parts:  # only empty files: tokenize_rows reports "no rows"
            return datasets.Dataset.from_dict({JSON_COLUMN: []})
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if fmt == "parquet":
        return datasets.Dataset.from_parquet(files, keep_in_memory=True)
    # arrow: a save_to_disk directory or .arrow files
    if _is_saved_dataset(files[0]):
        loaded = datasets.load_from_disk(files[0])
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"'{files[0]}' holds splits {list(loaded)}, none named 'train'")
            loaded = loaded["train"]
        return loaded
    parts = [datasets.Dataset.from_file(f, in_memory=True) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
