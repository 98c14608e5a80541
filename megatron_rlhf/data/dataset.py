"""Datasets for the three stages, read through `datasets` from local files only.

Three kinds of rows (field names come from `DataConfig`):

* ``"sft"``: ``{prompt, response}``, ``{messages: [{role, content}, ...]}`` (chat template of the
  tokenizer; loss on assistant tokens only), or prompt and response as message lists (loss on the response's
  assistant turns) -> ``input_ids``, ``loss_mask`` (1 where the token is a
  response token the model must predict; aligned with ``input_ids``).
* ``"preference"``: ``{prompt, chosen, rejected}``, or conversational pairs whose ``chosen`` and
  ``rejected`` are message lists (`_Tokenize._chat_pair`) -> ``chosen_ids``, ``rejected_ids`` (both start
  with the prompt) and ``prompt_len``.
* ``"prompt"``: ``{prompt}``, ``{messages}`` or ``{prompt: messages}`` (rendered with the generation prompt)
  -> ``prompt_ids``.

Malformed rows (missing field, wrong type, empty text, invalid JSON, messages the chat template cannot
render) are counted and skipped; the load stops with `DataError` when their fraction exceeds
``data.max_bad_fraction`` or no row is left. Over-long examples are
truncated or dropped (``data.overlong``) and counted: SFT and preference examples lose their end, prompts their
middle (`prompt_ends`: BOS and the instruction at the start, the generation cue at the end are kept). Every
load reports one summary line, a warning line when examples were truncated, and one when the chat template
failed on rows (their numbers and the template's first error).

Batches: `data/collate.py` turns examples into padded tensors; `data/sampler.py` decides which examples each
data-parallel rank takes at each step.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from megatron_rlhf.config.schema import DataConfig
from megatron_rlhf.data.report import TEMPLATE_ERROR, TOKENIZER_ERROR, DataReport, blame_tokenizer, prompt_ends
from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.data.files import JSON_COLUMN, read_rows
from megatron_rlhf.data.tokenizer import DataError

KINDS = ("sft", "preference", "prompt")
_STATUS = "_status"
_DETAIL = "_detail"  # what the chat template raised, for the warning naming the row (empty for other rows)
_OK, _TRUNCATED, _OVERLONG = "ok", "truncated", "overlong"


# --------------------------------------------------------------------------------------------
# Row validation and tokenisation
# --------------------------------------------------------------------------------------------


class _BadRow(Exception):
    """A malformed row; the message is the reason counted in the summary, `detail` what the row's own
    warning says (the chat template's error)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.detail = detail


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
    if row.get(name) is None:
        raise _BadRow(f"missing {name}")
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
        self.stops = T.stop_ids(tokenizer)  # where a sampled response ends: EOS and generation_config.json's ids

    def __call__(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        out = self._empty()
        try:
            row = self._parse(raw)
            result = getattr(self, f"_{self.kind}")(row)
        except _BadRow as e:
            out[_STATUS], out[_DETAIL] = f"bad:{e}", e.detail
            return out
        out.update(result)
        return out

    def _empty(self) -> Dict[str, Any]:
        if self.kind == "sft":
            return {"input_ids": [], "loss_mask": [], _STATUS: _OK, _DETAIL: ""}
        if self.kind == "preference":
            return {"chosen_ids": [], "rejected_ids": [], "prompt_len": 0, _STATUS: _OK, _DETAIL: ""}
        return {"prompt_ids": [], "prompt_source": "", _STATUS: _OK, _DETAIL: ""}

    def _parse(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        if not self.from_json:
            return raw
        try:
            row = json.loads(raw[JSON_COLUMN])
        except (json.JSONDecodeError, TypeError):
            raise _BadRow("invalid JSON") from None
        if not isinstance(row, dict):
            raise _BadRow("not a JSON object")
        return row

    def _encode(self, text: str, special: bool) -> List[int]:
        try:
            return list(self.tok(text, add_special_tokens=special)["input_ids"])
        except Exception as e:  # e.g. a word-level tokenizer without an unknown token
            raise _BadRow(f"{TOKENIZER_ERROR} ({type(e).__name__})") from None

    def _response(self, text: str) -> List[int]:
        ids = self._encode(text, special=False)
        return ids + [self.eos] if self.cfg.append_eos else ids

    def _need_template(self) -> None:
        if not getattr(self.tok, "chat_template", None):
            raise DataError(
                f"rows hold chat messages ('{self.cfg.messages_field}', or message lists in place of text) but "
                "the tokenizer has no chat template: "
                "use prompt/response rows or a tokenizer with a chat template"
            )

    def _template(self, messages, generation_prompt: bool) -> List[int]:
        self._need_template()
        try:
            ids = self.tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
            )
        except Exception as e:  # jinja's TemplateError from raise_exception (an unknown role), a missing key, ...
            text = " ".join(str(e).split())
            detail = f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
            raise _BadRow(f"{TEMPLATE_ERROR} ({type(e).__name__})", detail) from None
        return list(ids)

    # kinds ---------------------------------------------------------------------------------
    def _sft(self, row: Dict[str, Any]) -> Dict[str, Any]:
        c = self.cfg
        if c.messages_field in row and c.prompt_field not in row:
            ids, mask = self._chat(_messages(row, c.messages_field))
            n_prompt = mask.index(1) if 1 in mask else len(mask)
        elif isinstance(row.get(c.prompt_field), list) and isinstance(row.get(c.response_field), list):
            # prompt-completion rows of messages: the loss on the completion's assistant turns only
            prompt = _messages(row, c.prompt_field)
            ids, mask = self._chat(prompt + _messages(row, c.response_field), learn_from=len(prompt))
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

    def _chat(self, messages: List[Dict[str, str]], learn_from: int = 0):
        """Token ids of the whole conversation and a mask of the assistant turns from `learn_from` on.

        Each assistant turn i spans [len(render(messages[:i], generation prompt)),
        len(render(messages[:i+1]))): it includes the template's end-of-turn tokens, which the model
        must learn to emit. Templates whose renderings are not prefixes of each other are rejected.
        """
        if not any(m["role"] == "assistant" for m in messages[learn_from:]):
            raise _BadRow("no assistant message")
        full = self._template(messages, generation_prompt=False)
        mask = [0] * len(full)
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < learn_from:
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
        if isinstance(row.get(c.chosen_field), list) or isinstance(row.get(c.rejected_field), list):
            prompt, chosen, rejected = self._chat_pair(row)
        else:
            prompt = self._encode(_text(row, c.prompt_field), special=True)
            chosen_text, rejected_text = _text(row, c.chosen_field), _text(row, c.rejected_field)
            if chosen_text == rejected_text:
                raise _BadRow(f"{c.chosen_field} equals {c.rejected_field}")
            chosen, rejected = prompt + self._response(chosen_text), prompt + self._response(rejected_text)
        if chosen == rejected:  # texts that differ only where the tokenizer does not look (whitespace): no signal
            raise _BadRow(f"{c.chosen_field} equals {c.rejected_field} once tokenized")
        status = _OK
        if max(len(chosen), len(rejected)) > c.max_seq_len:
            if c.overlong == "drop" or len(prompt) >= c.max_seq_len:
                return {_STATUS: _OVERLONG}
            chosen, rejected, status = chosen[: c.max_seq_len], rejected[: c.max_seq_len], _TRUNCATED
            if chosen == rejected:  # the difference was cut off: no signal left
                return {_STATUS: _OVERLONG}
        return {"chosen_ids": chosen, "rejected_ids": rejected, "prompt_len": len(prompt), _STATUS: status}

    def _chat_pair(self, row: Dict[str, Any]) -> Tuple[List[int], List[int], List[int]]:
        """A conversational pair -> (prompt ids, chosen ids, rejected ids), both sequences starting with the prompt.

        `chosen` and `rejected` are message lists, as preference datasets on the Hub write them: whole
        conversations sharing every turn before their last (the prompt; a text `prompt` field beside them is
        not read), or one answer turn each after a `prompt` that is itself a message list. The prompt is
        rendered with the generation prompt, as PPO renders its prompts, and each answer ends after its first
        stop id (EOS, or any `eos_token_id` of the tokenizer's generation_config.json: the end of its turn, where a
        sampled response ends; EOS appended with `data.append_eos` when the template ends turns with a token of
        neither), so the reward model sees what PPO will show it."""
        c = self.cfg
        chosen, rejected = _messages(row, c.chosen_field), _messages(row, c.rejected_field)
        if isinstance(row.get(c.prompt_field), list):
            prompt = _messages(row, c.prompt_field)
        else:
            if chosen[:-1] != rejected[:-1]:
                raise _BadRow(f"{c.chosen_field} and {c.rejected_field} differ before their last turn")
            if len(chosen) < 2:
                raise _BadRow(f"no turns before the answer in {c.chosen_field}")
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        if len(chosen) != 1 or len(rejected) != 1 or any(m["role"] != "assistant" for m in chosen + rejected):
            raise _BadRow(f"{c.chosen_field} and {c.rejected_field} must end in one assistant turn each")
        if chosen == rejected:
            raise _BadRow(f"{c.chosen_field} equals {c.rejected_field}")
        head = self._template(prompt, generation_prompt=True)
        return head, self.answer(prompt, head, chosen), self.answer(prompt, head, rejected)

    def answer(self, prompt: List[Dict[str, str]], head: List[int], answer: List[Dict[str, str]]) -> List[int]:
        """`head` (the prompt rendered with the generation prompt) + the answer turn, cut after its first stop id
        (EOS appended with data.append_eos when the template ends the turn with no stop id)."""
        ids = self._template(prompt + answer, generation_prompt=False)
        if ids[: len(head)] != head:
            raise _BadRow("chat template is not prefix-stable")
        turn = ids[len(head):]
        end = T.first_stop(turn, self.stops)
        if end is not None:
            return head + turn[: end + 1]
        return head + turn + ([self.eos] if self.cfg.append_eos else [])

    def _prompt(self, row: Dict[str, Any]) -> Dict[str, Any]:
        c = self.cfg
        if c.messages_field in row and c.prompt_field not in row:
            source = _messages(row, c.messages_field)
        elif isinstance(row.get(c.prompt_field), list):  # a prompt of messages (conversational prompt-only rows)
            source = _messages(row, c.prompt_field)
        else:
            source = _text(row, c.prompt_field)
        ids = self.prompt_ids(source)
        # The prompt as written (text, or the messages): a reward model with its own tokenizer renders it itself.
        kept = {"prompt_source": json.dumps(source)}
        limit = c.max_prompt_len or c.max_seq_len
        if len(ids) > limit:
            if c.overlong == "drop":
                return {_STATUS: _OVERLONG}
            head, tail = prompt_ends(limit)
            return {"prompt_ids": ids[:head] + ids[len(ids) - tail:], **kept, _STATUS: _TRUNCATED}
        return {"prompt_ids": ids, **kept, _STATUS: _OK}

    def prompt_ids(self, source: Union[str, List[Dict[str, str]]]) -> List[int]:
        """A prompt (text, or messages) -> its ids: with the tokenizer's special tokens, or the chat template with
        the generation prompt."""
        if isinstance(source, list):
            return self._template(source, generation_prompt=True)
        return self._encode(source, special=True)

    def sequence(self, source: Union[str, List[Dict[str, str]]], response: str, ended: bool) -> Tuple[List[int], int]:
        """(ids, prompt length) of a prompt and a response text, as a preference row {prompt, chosen: response} is
        rendered: text: the prompt with special tokens, the response, EOS (data.append_eos); messages: the chat
        template, the answer turn cut at its first stop id. A response that did not end (`ended` False, cut at the
        length limit) gets no end of turn and no EOS."""
        head = self.prompt_ids(source)
        if not ended:
            return head + self._encode(response, special=False), len(head)
        if isinstance(source, list):
            return self.answer(source, head, [{"role": "assistant", "content": response}]), len(head)
        return head + self._response(response), len(head)


def row_renderer(cfg: DataConfig, tokenizer) -> _Tokenize:
    """What renders rows for `tokenizer` as the preference loader does: its `sequence(source, response, ended)` gives
    the ids of a prompt (text or messages) and a response text (PPO's reward model with its own tokenizer)."""
    return _Tokenize("preference", cfg, tokenizer, from_json=False)


def _features(kind: str):
    """Explicit column types: inference would fail when the first rows are bad (empty lists)."""
    from datasets import Features, List as DList, Value

    ids = DList(Value("int32"))
    cols = {
        "sft": {"input_ids": ids, "loss_mask": DList(Value("int8"))},
        "preference": {"chosen_ids": ids, "rejected_ids": ids, "prompt_len": Value("int32")},
        "prompt": {"prompt_ids": ids, "prompt_source": Value("string")},
    }[kind]
    return Features({**cols, _STATUS: Value("string"), _DETAIL: Value("string")})


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
    fn = _Tokenize(kind, cfg, tokenizer, from_json=JSON_COLUMN in raw.column_names)
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
        limit_key="data.max_prompt_len" if kind == "prompt" and cfg.max_prompt_len else "data.max_seq_len",
    )
    if report.total == 0:
        raise DataError(f"data {source}: no rows")
    if report.num_template_errors:
        failed = [i for i, s in enumerate(statuses) if s.startswith(f"bad:{TEMPLATE_ERROR}")]
        report.template_rows, report.template_error = [i + 1 for i in failed[:5]], ds[failed[0]][_DETAIL]
    first = f"; {report.first_template_error()}" if report.template_rows else ""  # the template's own words
    if report.num_bad == report.total:
        blame_tokenizer(report, statuses, tokenizer)
        raise DataError(f"data {source}: all {report.total} rows are malformed ({report.bad_text()}{first}): fix "
                        "the data or the data.*_field names" + (", or use a tokenizer whose chat template takes "
                                                                 "these messages" if first else ""))
    if report.bad_fraction > cfg.max_bad_fraction:
        blame_tokenizer(report, statuses, tokenizer)
        raise DataError(
            f"data {source}: {report.num_bad} of {report.total} rows ({100 * report.bad_fraction:.1f}%) are "
            f"malformed, more than data.max_bad_fraction={cfg.max_bad_fraction} ({report.bad_text()}{first}): "
            "fix the data, the data.*_field names, or raise data.max_bad_fraction"
        )
    keep = [i for i, s in enumerate(statuses) if s in (_OK, _TRUNCATED)]
    report.kept = len(keep)
    if not keep:
        fix = "raise data.max_seq_len" + (" or set data.overlong=truncate" if cfg.overlong == "drop" else "")
        bad = f"; {report.num_bad} malformed: {report.bad_text()}" if report.bad else ""
        raise DataError(
            f"data {source}: none of the {report.total} rows is usable ({report.dropped_overlong} longer than "
            f"{report.max_seq_len} tokens even after truncation{bad}): {fix}"
        )
    ds = ds.select(keep, keep_in_memory=True) if len(keep) < len(statuses) else ds
    return ds.remove_columns([_STATUS, _DETAIL]), report


def load_examples(kind: str, cfg: DataConfig, tokenizer, path: Optional[str] = None, log: Optional[Callable] = print):
    """Read + tokenise one file (default `cfg.train_path`) -> (Dataset, DataReport); logs the summary."""
    path = path or cfg.train_path
    if path is None:
        raise DataError("data.train_path is not set")
    ds, report = tokenize_rows(read_rows(path, cfg.format), kind, cfg, tokenizer, source=path)
    if log is not None:
        log(report.summary())
        for line in report.warnings():
            log(line)
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
