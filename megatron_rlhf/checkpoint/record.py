"""What each step directory records about the run that wrote it (`run.json`): its stage, its run id and
its tokenizer's fingerprint. Pruning (state.py) and resuming (run_dir.py) read the stage and run id; every
load checks the tokenizer (`check_tokenizer`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_rlhf.checkpoint.damage import CheckpointError

RUN_RECORD = "run.json"  # in each step directory: {"stage": ..., "run_id": ..., "tokenizer": {...}}
LATEST = "latest"  # in the checkpoint root: the name of the newest complete step directory, written last


@dataclass(frozen=True)
class RunRecord:
    """Which stage (sft, rm, ppo, dpo) and which run wrote a checkpoint; a resumed run keeps its run_id.
    `tokenizer`: the fingerprint of the run's tokenizer (data/tokenizer.py), checked by `check_tokenizer`."""

    stage: str
    run_id: str
    tokenizer: Optional[dict] = None

    @staticmethod
    def new(stage: str, tokenizer: Optional[dict] = None) -> "RunRecord":
        return RunRecord(stage, uuid.uuid4().hex, tokenizer)


def read_run_record(step_dir: Path) -> Optional[RunRecord]:
    """The record of a step directory; None for checkpoints written before records existed (or converted)."""
    try:
        raw = json.loads((Path(step_dir) / RUN_RECORD).read_text())
        tok = raw.get("tokenizer")
        return RunRecord(str(raw["stage"]), str(raw["run_id"]), tok if isinstance(tok, dict) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def latest_step_dir(root: Path) -> Optional[Path]:
    """The step directory `<root>/latest` names, None when there is none (no pointer yet, or a broken one).
    Readers of a finished or running run (the run report); a resuming run checks more (state.latest_checkpoint)."""
    try:
        name = (Path(root) / LATEST).read_text().strip()
    except OSError:
        return None
    path = Path(root) / name
    return path if name and path.is_dir() else None


def check_tokenizer(step_dir: Path, current: Optional[dict], key: str) -> None:
    """CheckpointError (one line naming both tokenizer directories) if `step_dir` was trained with another
    tokenizer than `current` (a fingerprint). No check when either is missing: `current` None means
    tokenizer.allow_swap=true (a deliberate swap), and checkpoints written before fingerprints existed, or
    converted from HF, record none, so they load as before."""
    record = read_run_record(step_dir)
    recorded = record.tokenizer if record is not None else None
    if current is None or recorded is None:
        return
    if recorded.get("vocab") == current.get("vocab") and recorded.get("special") == current.get("special"):
        return
    setting = current.get("setting", "tokenizer.path")  # the one that named `current` (run.expected_tokenizer)
    raise CheckpointError(
        f"{key}: {step_dir} was trained with the tokenizer in '{recorded.get('path')}', and {setting} "
        f"'{current.get('path')}' is another one ({_tokenizer_difference(recorded, current)}): the model would "
        f"read token ids that mean other words; set {setting} to '{recorded.get('path')}' (or a copy), or "
        "tokenizer.allow_swap=true to swap tokenizers deliberately")


def _tokenizer_difference(recorded: dict, current: dict) -> str:
    if recorded.get("size") != current.get("size"):
        return f"{recorded.get('size')} tokens there, {current.get('size')} here"
    if recorded.get("vocab") != current.get("vocab"):
        return f"both have {current.get('size')} tokens, mapped to other ids"
    was, now = recorded.get("special") or {}, current.get("special") or {}
    return "the same vocabulary, other special tokens: " + "; ".join(
        f"{n} {was.get(n)} there, {now.get(n)} here" for n in sorted(set(was) | set(now)) if was.get(n) != now.get(n))
