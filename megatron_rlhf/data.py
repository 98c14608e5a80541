"""Datasets for the three stages, read through `datasets` from local files only.

Three kinds of rows (field names come from `DataConfig`):

* ``"sft"``: ``{prompt, response}`` or ``{messages: [{role, content}, ...]}`` (chat template of the
  tokenizer; loss on assistant tokens only) -> ``input_ids``, ``loss_mask`` (1 where the token is a
  response token the model must predict; aligned with ``input_ids``).
* ``"preference"``: ``{prompt, chosen, rejected}`` -> ``chosen_ids``, ``rejected_ids`` (both start
  with the prompt) and ``prompt_len``.
* ``"prompt"``: ``{prompt}`` or ``{messages}`` (rendered with the generation prompt) -> ``prompt_ids``.

Malformed rows (missing field, wrong type, empty text, invalid JSON) are counted and skipped; the load
stops with `DataError` when their fraction exceeds ``data.max_bad_fraction``. Over-long examples are
truncated or dropped (``data.overlong``) and counted. Every load reports one summary line.

Iteration: `ShardedBatchSampler` cuts each epoch's seeded permutation into global batches and hands
each data-parallel rank its contiguous share; its cursor (epoch, step in epoch) is checkpointed so a
resumed run sees exactly the batches it would have seen. The `collate_*` functions build right-padded
(prompts: left-padded) tensors.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from megatron_rlhf.config import DataConfig

KINDS = ("sft", "preference", "prompt")
FORMATS = ("jsonl", "json", "parquet", "arrow")
_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_JSON_COLUMN = "_json"  # json/jsonl rows are read as raw text lines and parsed per row (see read_rows)
_STATUS = "_status"
_OK, _TRUNCATED, _OVERLONG = "ok", "truncated", "overlong"


class DataError(ValueError):
    """Unusable data. The message is one line naming the file, the numbers and the fix."""


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def load_tokenizer(path: str):
    """A local HF tokenizer (no hub access). A missing pad token falls back to EOS: collate never
    relies on the pad id to find real tokens (it uses lengths), so this is safe."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise DataError(f"tokenizer.path: '{path}' is not a directory holding an HF tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"tokenizer.path: could not load a tokenizer from '{path}': {first}") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def check_vocab(tokenizer, vocab_size: int) -> None:
    """`DataError` if the tokenizer can produce ids the model has no embedding for."""
    if len(tokenizer) > vocab_size:
        raise DataError(
            f"tokenizer has {len(tokenizer)} tokens but model.vocab_size={vocab_size}: use the model's tokenizer"
        )


# --------------------------------------------------------------------------------------------
# Reading raw rows
# --------------------------------------------------------------------------------------------


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
            parts.append(ds.rename_column("text", _JSON_COLUMN))
        if texts:
            parts.append(datasets.Dataset.from_dict({_JSON_COLUMN: texts}))
        if not parts:  # only empty files: tokenize_rows reports "no rows"
            return datasets.Dataset.from_dict({_JSON_COLUMN: []})
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


# --------------------------------------------------------------------------------------------
# Row validation and tokenisation
# --------------------------------------------------------------------------------------------


class _BadRow(Exception):
    """A malformed row; the message is the reason counted in the summary."""


def _text(row: Dict[str, Any], name: str) -> str:
    if name not in row or row[name] is None:
        raise _BadRow(f"missing {name}")
    value = row[name]
    if not isinstance(value, str):
        raise _BadRow(f"wrong type {name}")
    if not value.strip():
        raise _BadRow(f"empty {name}")
    return value


def _messages(row: Dict[str, Any], name: str) -> List[Dict[str, str]]:
    value = row[name]
    if not isinstance(value, list):
        raise _BadRow(f"wrong type {name}")
    if not value:
        raise _BadRow(f"empty {name}")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _BadRow(f"malformed {name} (need role and content strings)")
        if not m["content"].strip():
            raise _BadRow(f"empty {name} content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


class _Tokenize:
    """Row -> tokenised example + status. A class (not a closure) so `datasets.map` can pickle it."""

    def __init__(self, kind: str, cfg: DataConfig, tokenizer, from_json: bool):
        self.kind, self.cfg, self.tok, self.from_json = kind, cfg, tokenizer, from_json
        self.eos = tokenizer.eos_token_id

    def __call__(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        out = self._empty()
        try:
            row = self._parse(raw)
            result = getattr(self, f"_{self.kind}")(row)
        except _BadRow as e:
            out[_STATUS] = f"bad:{e}"
            return out
        out.update(result)
        return out

    def _empty(self) -> Dict[str, Any]:
        if self.kind == "sft":
            return {"input_ids": [], "loss_mask": [], _STATUS: _OK}
        if self.kind == "preference":
            return {"chosen_ids": [], "rejected_ids": [], "prompt_len": 0, _STATUS: _OK}
        return {"prompt_ids": [], _STATUS: _OK}

    def _parse(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        if not self.from_json:
            return raw
        try:
            row = json.loads(raw[_JSON_COLUMN])
        except (json.JSONDecodeError, TypeError):
            raise _BadRow("invalid JSON") from None
        if not isinstance(row, dict):
            raise _BadRow("not a JSON object")
        return row

    def _encode(self, text: str, special: bool) -> List[int]:
        try:
            return list(self.tok(text, add_special_tokens=special)["input_ids"])
        except Exception as e:  # e.g. a word-level tokenizer without an unknown token
            raise _BadRow(f"tokenizer error ({type(e).__name__})") from None

    def _response(self, text: str) -> List[int]:
        ids = self._encode(text, special=False)
        return ids + [self.eos] if self.cfg.append_eos else ids

    def _need_template(self) -> None:
        if not getattr(self.tok, "chat_template", None):
            raise DataError(
                f"rows have '{self.cfg.messages_field}' but the tokenizer has no chat template: "
                "use prompt/response rows or a tokenizer with a chat template"
            )

    def _template(self, messages, generation_prompt: bool) -> List[int]:
        self._need_template()
        try:
            ids = self.tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
            )
        except Exception as e:
            raise _BadRow(f"chat template error ({type(e).__name__})") from None
        return list(ids)

    # kinds ---------------------------------------------------------------------------------
    def _sft(self, row: Dict[str, Any]) -> Dict[str, Any]:
        c = self.cfg
        if c.messages_field in row and c.prompt_field not in row:
            self._need_template()
            ids, mask = self._chat(_messages(row, c.messages_field))
            n_prompt = mask.index(1) if 1 in mask else len(mask)
        else:
            prompt = self._encode(_text(row, c.prompt_field), special=True)
            response = self._response(_text(row, c.response_field))
            ids, mask, n_prompt = prompt + response, [0] * len(prompt) + [1] * len(response), len(prompt)
        status = _OK
        if len(ids) > c.max_seq_len:
            if c.overlong == "drop" or n_prompt >= c.max_seq_len:
                return {_STATUS: _OVERLONG}
            ids, mask, status = ids[: c.max_seq_len], mask[: c.max_seq_len], _TRUNCATED
            if not any(mask):
                return {_STATUS: _OVERLONG}
        return {"input_ids": ids, "loss_mask": mask, _STATUS: status}

    def _chat(self, messages: List[Dict[str, str]]):
        """Token ids of the whole conversation and a mask of the assistant turns.

        Each assistant turn i spans [len(render(messages[:i], generation prompt)),
        len(render(messages[:i+1]))): it includes the template's end-of-turn tokens, which the model
        must learn to emit. Templates whose renderings are not prefixes of each other are rejected.
        """
        if not any(m["role"] == "assistant" for m in messages):
            raise _BadRow("no assistant message")
        full = self._template(messages, generation_prompt=False)
        mask = [0] * len(full)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._template(messages[:i], generation_prompt=True) if i else []
            through = self._template(messages[: i + 1], generation_prompt=False)
            if through[: len(before)] != before or full[: len(through)] != through:
                raise _BadRow("chat template is not prefix-stable")
            for t in range(len(before), len(through)):
                mask[t] = 1
        return full, mask

    def _preference(self, row: Dict[str, Any]) -> Dict[str, Any]:
        c = self.cfg
        prompt = self._encode(_text(row, c.prompt_field), special=True)
        chosen_text, rejected_text = _text(row, c.chosen_field), _text(row, c.rejected_field)
        if chosen_text == rejected_text:
            raise _BadRow(f"{c.chosen_field} equals {c.rejected_field}")
        chosen, rejected = prompt + self._response(chosen_text), prompt + self._response(rejected_text)
        status = _OK
        if max(len(chosen), len(rejected)) > c.max_seq_len:
            if c.overlong == "drop" or len(prompt) >= c.max_seq_len:
                return {_STATUS: _OVERLONG}
            chosen, rejected, status = chosen[: c.max_seq_len], rejected[: c.max_seq_len], _TRUNCATED
            if chosen == rejected:  # the difference was cut off: no signal left
                return {_STATUS: _OVERLONG}
        return {"chosen_ids": chosen, "rejected_ids": rejected, "prompt_len": len(prompt), _STATUS: status}

    def _prompt(self, row: Dict[str, Any]) -> Dict[str, Any]:
        c = self.cfg
        if c.messages_field in row and c.prompt_field not in row:
            self._need_template()
            ids = self._template(_messages(row, c.messages_field), generation_prompt=True)
        else:
            ids = self._encode(_text(row, c.prompt_field), special=True)
        limit = c.max_prompt_len or c.max_seq_len
        if len(ids) > limit:
            if c.overlong == "drop":
                return {_STATUS: _OVERLONG}
            # keep the end: that is where the question and the generation cue are
            return {"prompt_ids": ids[-limit:], _STATUS: _TRUNCATED}
        return {"prompt_ids": ids, _STATUS: _OK}


@dataclass
class DataReport:
    """What happened to the rows of one file; `summary()` is the one line printed at load."""

    source: str
    kind: str
    total: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    bad: Dict[str, int] = field(default_factory=dict)
    max_seq_len: int = 0

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.total if self.total else 0.0

    def _bad_text(self) -> str:
        return ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad.items(), key=lambda kv: -kv[1]))

    def summary(self) -> str:
        parts = [f"data {self.source} ({self.kind}): {self.total} rows, {self.kept} kept"]
        if self.bad:
            parts.append(f"{self.num_bad} malformed skipped ({self._bad_text()})")
        parts.append(f"{self.truncated} truncated and {self.dropped_overlong} dropped as longer than {self.max_seq_len} tokens")
        return "; ".join(parts)


def _features(kind: str):
    """Explicit column types: inference would fail when the first rows are bad (empty lists)."""
    from datasets import Features, List as DList, Value

    ids = DList(Value("int32"))
    cols = {
        "sft": {"input_ids": ids, "loss_mask": DList(Value("int8"))},
        "preference": {"chosen_ids": ids, "rejected_ids": ids, "prompt_len": Value("int32")},
        "prompt": {"prompt_ids": ids},
    }[kind]
    return Features({**cols, _STATUS: Value("string")})


def tokenize_rows(raw, kind: str, cfg: DataConfig, tokenizer, source: str = "data"):
    """Validate and tokenise raw rows -> (`datasets.Dataset` of examples, `DataReport`).

    Raises `DataError` if more than `cfg.max_bad_fraction` of the rows are malformed or none is usable.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    if cfg.append_eos and kind != "prompt" and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token: set data.append_eos=false or use another tokenizer")
    if len(raw) == 0:  # checked before `map`, which gives an empty dataset no columns
        raise DataError(f"data {source}: no rows (the file is empty or holds only blank lines): give one JSON "
                        "object per line, or a json/parquet/arrow file with rows")
    fn = _Tokenize(kind, cfg, tokenizer, from_json=_JSON_COLUMN in raw.column_names)
    # An explicit fingerprint: datasets would otherwise try to hash the tokenizer (slow, warns).
    fingerprint = hashlib.sha1(
        f"{raw._fingerprint}|{kind}|{cfg}|{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}".encode()
    ).hexdigest()
    ds = raw.map(
        fn,
        remove_columns=raw.column_names,
        features=_features(kind),
        keep_in_memory=True,
        load_from_cache_file=False,
        new_fingerprint=fingerprint,
        num_proc=cfg.num_proc if cfg.num_proc > 1 and len(raw) > 1000 else None,
    )
    statuses = ds[_STATUS]
    counts = Counter(statuses)
    report = DataReport(
        source=source,
        kind=kind,
        total=len(statuses),
        truncated=counts.get(_TRUNCATED, 0),
        dropped_overlong=counts.get(_OVERLONG, 0),
        bad={s[4:]: n for s, n in counts.items() if s.startswith("bad:")},
        max_seq_len=(cfg.max_prompt_len or cfg.max_seq_len) if kind == "prompt" else cfg.max_seq_len,
    )
    if report.total == 0:
        raise DataError(f"data {source}: no rows")
    if report.bad_fraction > cfg.max_bad_fraction:
        raise DataError(
            f"data {source}: {report.num_bad} of {report.total} rows ({100 * report.bad_fraction:.1f}%) are "
            f"malformed, more than data.max_bad_fraction={cfg.max_bad_fraction} ({report._bad_text()}): "
            "fix the data, the data.*_field names, or raise data.max_bad_fraction"
        )
    keep = [i for i, s in enumerate(statuses) if s in (_OK, _TRUNCATED)]
    report.kept = len(keep)
    if not keep:
        fix = "raise data.max_seq_len" + (" or set data.overlong=truncate" if cfg.overlong == "drop" else "")
        raise DataError(
            f"data {source}: none of the {report.total} rows is usable ({report.dropped_overlong} longer than "
            f"{report.max_seq_len} tokens even after truncation): {fix}"
        )
    ds = ds.select(keep, keep_in_memory=True) if len(keep) < len(statuses) else ds
    return ds.remove_columns(_STATUS), report


def load_examples(kind: str, cfg: DataConfig, tokenizer, path: Optional[str] = None, log: Optional[Callable] = print):
    """Read + tokenise one file (default `cfg.train_path`) -> (Dataset, DataReport); logs the summary."""
    path = path or cfg.train_path
    if path is None:
        raise DataError("data.train_path is not set")
    ds, report = tokenize_rows(read_rows(path, cfg.format), kind, cfg, tokenizer, source=path)
    if log is not None:
        log(report.summary())
    return ds, report


@dataclass
class Splits:
    train: Any  # datasets.Dataset
    eval: Optional[Any]  # datasets.Dataset or None
    reports: List[DataReport]


def load_splits(kind: str, cfg: DataConfig, tokenizer, log: Optional[Callable] = print) -> Splits:
    """Train and held-out examples: `eval_path` when given, else a seeded `eval_fraction` of train rows."""
    train, report = load_examples(kind, cfg, tokenizer, cfg.train_path, log)
    reports = [report]
    held_out = None
    if cfg.eval_path:
        held_out, eval_report = load_examples(kind, cfg, tokenizer, cfg.eval_path, log)
        reports.append(eval_report)
    elif cfg.eval_fraction > 0:
        n = len(train)
        n_eval = max(1, int(round(cfg.eval_fraction * n)))
        if n_eval >= n:
            raise DataError(f"data.eval_fraction={cfg.eval_fraction} leaves no training rows out of {n}")
        perm = np.random.default_rng([cfg.seed or 0, 7]).permutation(n)
        held_out = train.select(sorted(perm[:n_eval].tolist()), keep_in_memory=True)
        train = train.select(sorted(perm[n_eval:].tolist()), keep_in_memory=True)
        if log is not None:
            log(f"data: held out {n_eval} of {n} examples for evaluation (data.eval_fraction={cfg.eval_fraction})")
    return Splits(train, held_out, reports)


# --------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------


def _target_length(lengths: Sequence[int], pad_to: Optional[int], multiple_of: int) -> int:
    longest = max(lengths) if lengths else 0
    if pad_to is not None:
        if longest > pad_to:
            raise ValueError(f"an example has {longest} tokens, more than pad_to={pad_to}")
        longest = pad_to
    return -(-longest // multiple_of) * multiple_of


def pad_sequences(
    seqs: Sequence[Sequence[int]],
    pad_value: float,
    *,
    side: str = "right",
    pad_to: Optional[int] = None,
    multiple_of: int = 1,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """[b, s] tensor of `seqs` padded with `pad_value` on `side` to the longest (or `pad_to`),
    rounded up to `multiple_of` (sequence parallel needs s % tp == 0; pipelines need a fixed s)."""
    s = _target_length([len(x) for x in seqs], pad_to, multiple_of)
    out = torch.full((len(seqs), s), pad_value, dtype=dtype)
    for i, x in enumerate(seqs):
        if len(x):
            if side == "right":
                out[i, : len(x)] = torch.as_tensor(x, dtype=dtype)
            else:
                out[i, s - len(x) :] = torch.as_tensor(x, dtype=dtype)
    return out


def _common(seqs: Sequence[Sequence[int]], pad_id: int, pad_to: Optional[int], multiple_of: int) -> Dict[str, torch.Tensor]:
    ids = pad_sequences(seqs, pad_id, pad_to=pad_to, multiple_of=multiple_of)
    lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous()
    return {
        "input_ids": ids,  # [b, s] long
        "attention_mask": positions < lengths.unsqueeze(1),  # [b, s] bool, True at real tokens
        "position_ids": positions,  # [b, s] long
        "lengths": lengths,  # [b] long
    }


def collate_sft(
    examples: Sequence[Dict[str, Any]], pad_id: int, pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """SFT examples -> right-padded batch.

    input_ids, labels [b, s] long; loss_mask [b, s] float32; attention_mask [b, s] bool; position_ids
    [b, s]; lengths [b]. Next-token targets are already shifted: the loss at position t is
    ``CE(logits[:, t], labels[:, t]) * loss_mask[:, t]`` (labels[:, t] = input_ids[:, t + 1]).
    Right padding keeps the real tokens causal, so the model's default causal mask is enough.
    """
    batch = _common([e["input_ids"] for e in examples], pad_id, pad_to, multiple_of)
    ids = batch["input_ids"]
    mask = pad_sequences([e["loss_mask"] for e in examples], 0, pad_to=ids.shape[1], dtype=torch.float32)
    labels = torch.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    loss_mask = torch.zeros_like(mask)
    loss_mask[:, :-1] = mask[:, 1:]
    batch.update(labels=labels, loss_mask=loss_mask)
    return batch


def collate_preference(
    examples: Sequence[Dict[str, Any]], pad_id: int, pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """Preference pairs -> one right-padded batch of 2b sequences: rows [0, b) are chosen, [b, 2b)
    rejected (one forward pass scores both). input_ids, attention_mask, position_ids [2b, s];
    lengths [2b] (the score is read at ``lengths - 1``, the last real token); prompt_lens [b]."""
    seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    batch = _common(seqs, pad_id, pad_to, multiple_of)
    batch["prompt_lens"] = torch.tensor([e["prompt_len"] for e in examples], dtype=torch.long)
    return batch


def collate_prompts(
    examples: Sequence[Dict[str, Any]], pad_id: int, side: str = "left", pad_to: Optional[int] = None, multiple_of: int = 1
) -> Dict[str, torch.Tensor]:
    """Prompts for generation, left-padded by default so every prompt ends at the same column.
    input_ids [b, s]; attention_mask [b, s] bool; position_ids [b, s] (0 at each prompt's first real
    token, 0 on padding); lengths [b]."""
    seqs = [e["prompt_ids"] for e in examples]
    ids = pad_sequences(seqs, pad_id, side=side, pad_to=pad_to, multiple_of=multiple_of)
    lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    cols = torch.arange(ids.shape[1]).unsqueeze(0)
    if side == "left":
        attention = cols >= (ids.shape[1] - lengths).unsqueeze(1)
    else:
        attention = cols < lengths.unsqueeze(1)
    positions = (attention.long().cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions, "lengths": lengths}


COLLATE = {"sft": collate_sft, "preference": collate_preference, "prompt": collate_prompts}


def microbatches(dataset, indices: Sequence[int], micro_batch_size: int, collate: Callable, **kwargs) -> List[Dict]:
    """This rank's share of one step, as a list of collated micro-batches (for Megatron's schedule:
    ``forward_backward_func(data_iterator=iter(mbs), num_microbatches=len(mbs), ...)``)."""
    if len(indices) % micro_batch_size != 0:
        raise ValueError(f"{len(indices)} indices do not split into micro-batches of {micro_batch_size}")
    out = []
    for start in range(0, len(indices), micro_batch_size):
        idx = [int(i) for i in indices[start : start + micro_batch_size]]
        if isinstance(dataset, (list, tuple)):
            rows = [dataset[i] for i in idx]
        else:  # datasets.Dataset: one batched read returns columns
            cols = dataset[idx]
            rows = [{k: cols[k][i] for k in cols} for i in range(len(idx))]
        out.append(collate(rows, **kwargs))
    return out


# --------------------------------------------------------------------------------------------
# Sharded, resumable iteration
# --------------------------------------------------------------------------------------------


class ShardedBatchSampler:
    """Per-step index lists for one data-parallel rank; deterministic and resumable.

    Epoch e uses the permutation `default_rng([seed, e])` of range(dataset_size) (identity with
    shuffle=False), cut into `steps_per_epoch = dataset_size // global_batch_size` global batches (the
    remainder is skipped this epoch; the next permutation differs). Rank r of dp_size receives the
    r-th contiguous slice of each global batch, so the union over ranks is the global batch and each
    index appears at most once per epoch. The cursor is global (not per rank): a checkpoint taken at
    one data-parallel size resumes at another with the same global batches.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if global_batch_size % dp_size != 0:
            raise DataError(
                f"train.global_batch_size={global_batch_size} is not divisible by the data-parallel size {dp_size}"
            )
        if dataset_size < global_batch_size:
            raise DataError(
                f"the dataset has {dataset_size} examples, fewer than one global batch "
                f"(train.global_batch_size={global_batch_size}): lower the batch size or add data"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, {dp_size})")
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.epoch, self.step_in_epoch = 0, 0
        self._perm_epoch, self._perm = -1, None

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def consumed_steps(self) -> int:
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
            else:
                self._perm = np.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, epoch: int, step: int) -> List[int]:
        """All indices of global batch `step` of `epoch` (every rank's share, in rank order)."""
        perm = self._permutation(epoch)
        start = step * self.global_batch_size
        return perm[start : start + self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        return self

    def __next__(self) -> List[int]:
        """This rank's indices for the next step; advances the cursor (endless: epochs roll over)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        batch = self.global_batch(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        return batch[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]

    def state_dict(self) -> Dict[str, int]:
        """The cursor: the next step to yield is (epoch, step_in_epoch). Plain ints (checkpoint-safe)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key in ("seed", "dataset_size", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(
                    f"cannot resume the data cursor: the checkpoint has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same data and batch size, or start fresh "
                    "(checkpoint.resume=never)"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def eval_batches(dataset_size: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[List[int]]:
    """In-order evaluation batches covering every index exactly once. This rank gets its contiguous
    share of each global batch; the last share may be shorter or empty, so sum metrics and counts and
    all-reduce them (never average per rank)."""
    for start in range(0, dataset_size, global_batch_size):
        stop = min(start + global_batch_size, dataset_size)
        n = stop - start
        per = -(-n // dp_size)
        lo = start + min(n, dp_rank * per)
        hi = start + min(n, (dp_rank + 1) * per)
        yield list(range(lo, hi))
