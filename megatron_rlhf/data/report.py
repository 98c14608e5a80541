"""What a data load did to its rows: the counts, the one summary line and the warnings (`DataReport`), the
reasons a row is bad that are not the data's own fault, and where an over-long prompt is cut (`prompt_ends`).
data/dataset.py fills a report per file it loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_rlhf.data.tokenizer import DataError

TOKENIZER_ERROR = "tokenizer error"  # a bad-row reason that is the tokenizer's fault, not the data's
TEMPLATE_ERROR = "chat template error"  # a row the chat template raised on (an unknown role, say)


def prompt_ends(limit: int) -> tuple:
    """How an over-long prompt is cut under data.overlong=truncate: its first and last tokens are kept and the
    middle dropped. The start holds BOS, the system prompt and the instruction; the end holds the question's
    last words and the chat template's generation cue (e.g. '<|im_start|>assistant'), without which the model
    continues the user's turn instead of answering. Cutting either end off loses more than the middle does."""
    return (limit + 1) // 2, limit // 2


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
    limit_key: str = "data.max_seq_len"  # the setting max_seq_len came from
    # The first few rows the chat template raised on: 1-based, in the order the source's rows are read (blank
    # lines not counted), as tokenizer errors name rows.
    template_rows: List[int] = field(default_factory=list)
    template_error: str = ""  # what it raised on the first of them

    @property
    def num_template_errors(self) -> int:
        return sum(n for reason, n in self.bad.items() if reason.startswith(TEMPLATE_ERROR))

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.total if self.total else 0.0

    def bad_text(self) -> str:
        return ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad.items(), key=lambda kv: -kv[1]))

    def warnings(self) -> List[str]:
        """The truncation and chat-template warnings (one line each) that apply."""
        return [w for w in (self.warning(), self.template_warning()) if w]

    def first_template_error(self) -> str:
        return f"row {self.template_rows[0]}: {self.template_error}" if self.template_rows else ""

    def template_warning(self) -> Optional[str]:
        """One line when the chat template raised on rows: which rows, and the template's own error."""
        n = self.num_template_errors
        if not n:
            return None
        rows = ", ".join(map(str, self.template_rows)) + (", ..." if n > len(self.template_rows) else "")
        said = self.template_error if n == 1 else self.first_template_error()
        return (f"warning: data {self.source}: the chat template cannot render {n} of {self.total} rows, skipped: "
                f"row{'s' if n > 1 else ''} {rows} ({said}): fix their messages (roles the template knows, in an "
                "order it accepts) or use a tokenizer whose chat template takes them")

    def warning(self) -> Optional[str]:
        """One line when examples were truncated: a number in the summary is easy to miss."""
        if not self.truncated:
            return None
        if self.kind == "prompt":
            head, tail = prompt_ends(self.max_seq_len)
            how = f"cut in the middle (their first {head} and last {tail} tokens kept)"
        else:
            how = "cut at the end (responses shortened)"
        return (f"warning: data {self.source}: {self.truncated} of {self.total} {self.kind} examples are longer than "
                f"{self.max_seq_len} tokens and were {how}: raise {self.limit_key}, or set data.overlong=drop to "
                "skip them")

    def summary(self) -> str:
        parts = [f"data {self.source} ({self.kind}): {self.total} rows, {self.kept} kept"]
        if self.bad:
            parts.append(f"{self.num_bad} malformed skipped ({self.bad_text()})")
        parts.append(f"{self.truncated} truncated and {self.dropped_overlong} dropped as longer than {self.max_seq_len} tokens")
        return "; ".join(parts)


def blame_tokenizer(report: DataReport, statuses: List[str], tokenizer) -> None:
    """When most bad rows are rows the tokenizer cannot encode (a word-level vocabulary without the data's
    digits, say), the data is fine and `tokenizer.path` is what to fix: one line saying so."""
    failed = sum(n for reason, n in report.bad.items() if reason.startswith(TOKENIZER_ERROR))
    if failed * 2 <= report.num_bad:
        return
    first = next(i for i, s in enumerate(statuses) if s.startswith(f"bad:{TOKENIZER_ERROR}"))
    raise DataError(
        f"tokenizer.path: the tokenizer in '{tokenizer.name_or_path}' cannot encode {failed} of the {report.total} "
        f"rows of {report.source} (the first is row {first + 1}): it lacks tokens this data uses; use the "
        "tokenizer the data and the model were made with")
