"""A run directory as the report reads it: metrics, config, summaries, samples, doctor findings, checkpoints.

::

    runs = load_runs(["runs/tiny/ppo", "runs/b/ppo"])   # ReportError (one line) for a directory that is no run
    run.stage                 # "sft" | "rm" | "ppo" | "dpo": checkpoints' run.json, else config.yaml, else metric keys
    run.series("ppo/rm_score")   # (steps, values): values float, NaN where the run logged a non-finite number
    findings(run)             # doctor findings, one per span of consecutive iterations a warn/<name> count rose
    run.samples               # {iteration: [{"prompt", "response", "rm_score", "gold_score"}]}: samples.jsonl

Files read, each optional but one of the first two: metrics.jsonl (rows {"step", "wall_time", "<ns>/<name>": float};
a resumed run appends, so rows are merged per step in file order and a later value wins), config.yaml, *.json
summaries beside them (summary.json, reward_calibration.json), samples.jsonl (PPO), and the checkpoint root's
`latest` (checkpoint.dir, or <run_dir>/checkpoints). A run that is still going or stopped early reports what it has.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rlhf.checkpoint.record import latest_step_dir, read_run_record
from megatron_rlhf.trainer.metrics import read_jsonl
from megatron_rlhf.trainer.ppo import doctor as D

STAGES = ("sft", "rm", "ppo", "dpo")  # pipeline order: the report's sections follow it
SAMPLES_FILE = "samples.jsonl"  # trainer/ppo/fit.py SAMPLES_FILE
# What each doctor finding watches (trainer/ppo/doctor.py): the values the findings table quotes.
WATCHED = {
    "kl_blowup": (D.KL,), "clip_fraction": (D.CLIP,), "approx_kl": (D.APPROX_KL,), "negative_kl": (D.KL,),
    "value_lag": (D.EV,), "entropy_collapse": (D.ENTROPY,), "truncation_rising": (D.TRUNC, D.LENGTH),
    "rho_off": (D.RHO,), "reward_hacking": (D.GOLD, D.RM), "no_signal": (D.FLAT,),
}  # fmt: skip


class ReportError(ValueError):
    """A path that cannot be reported on; the message names it and what to give instead."""


@dataclass
class Run:
    """One run directory. `rows`: {step: merged metrics row}; `jsons`: {file name: dict} of the top-level
    *.json summaries; `checkpoint`: the latest step directory (None before the first save)."""

    path: Path
    label: str
    stage: str
    rows: Dict[int, Dict[str, float]]
    config_text: Optional[str]
    config: dict
    jsons: Dict[str, dict] = field(default_factory=dict)
    samples: Dict[int, List[dict]] = field(default_factory=dict)
    checkpoint_root: Optional[Path] = None
    checkpoint: Optional[Path] = None

    @property
    def steps(self) -> List[int]:
        return sorted(self.rows)

    def keys(self) -> List[str]:
        """Every metric key this run logged (step and wall_time excluded), sorted."""
        return sorted({k for r in self.rows.values() for k in r} - {"step", "wall_time"})

    def series(self, key: str) -> Tuple[List[int], List[float]]:
        """(steps, values) of the rows that hold `key`; non-numbers become NaN (a gap in a plot)."""
        xs, ys = [], []
        for step in self.steps:
            if key in self.rows[step]:
                xs.append(step)
                ys.append(_float(self.rows[step][key]))
        return xs, ys

    def first_non_finite(self) -> Optional[Tuple[int, List[str]]]:
        """(step, keys) of the first step that logged NaN or inf (a diverged run), None if none did."""
        for step in self.steps:
            bad = sorted(k for k, v in self.rows[step].items() if k not in ("step", "wall_time")
                         and not math.isfinite(_float(v)))
            if bad:
                return step, bad
        return None

    def target_steps(self) -> Optional[int]:
        """The steps (PPO: iterations) the config asks for, when it says (an epochs-only run does not)."""
        group = self.config.get("ppo") if self.stage == "ppo" else self.config.get("train")
        value = (group or {}).get("iterations" if self.stage == "ppo" else "train_steps")
        return value if isinstance(value, int) else None

    def status(self) -> str:
        """One line: how far the run got and whether it diverged."""
        unit = "iteration" if self.stage == "ppo" else "step"
        if not self.rows:
            text = "no metrics logged yet"
        else:
            target = self.target_steps()
            text = f"last logged {unit} {self.steps[-1]}" + (f" of {target}" if target else "")
        if "summary.json" in self.jsons:
            text += "; finished (summary.json written)"
        bad = self.first_non_finite()
        if bad is not None:
            shown = ", ".join(bad[1][:3]) + (" ..." if len(bad[1]) > 3 else "")
            text += f"; non-finite values from {unit} {bad[0]} ({shown}): diverged"
        return text


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # null (a NaN written by write_json) or a string


def merged_rows(path: Path) -> Dict[int, Dict[str, float]]:
    """metrics.jsonl as {step: row}: the rows of a step merged in file order (a stage logs its train and eval
    scalars of one step in two rows; a resumed run appends the steps after its checkpoint again)."""
    out: Dict[int, Dict[str, float]] = {}
    for row in read_jsonl(str(path), skip_bad=True):
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.setdefault(row["step"], {}).update(row)
    return out


def load_run(path: str, label: Optional[str] = None) -> Run:
    """The run in directory `path`; ReportError when it holds neither metrics.jsonl nor config.yaml."""
    d = Path(path)
    metrics, config_file = d / "metrics.jsonl", d / "config.yaml"
    if not metrics.is_file() and not config_file.is_file():
        raise ReportError(f"{path} is not a run directory (no metrics.jsonl): give a stage's logging.run_dir"
                          + _runs_inside(d))
    config_text = config_file.read_text() if config_file.is_file() else None
    config = _parse_yaml(config_text)
    rows = merged_rows(metrics) if metrics.is_file() else {}
    root = _checkpoint_root(d, config)
    latest = latest_step_dir(root) if root is not None else None
    record = read_run_record(latest) if latest is not None else None
    stage = record.stage if record is not None and record.stage in STAGES else _stage_of(config, rows)
    jsons = {p.name: v for p in sorted(d.glob("*.json")) if isinstance(v := _read_json(p), dict)}
    samples = read_samples(d / SAMPLES_FILE)
    return Run(d, label or d.name, stage, rows, config_text, config, jsons, samples, root, latest)


def load_runs(paths: Sequence[str]) -> List[Run]:
    """The runs of `paths`, each labelled by its directory name, with parent directories added until the labels
    differ (runs/a/ppo and runs/b/ppo -> a/ppo, b/ppo)."""
    return [load_run(p, label) for p, label in zip(paths, labels(paths))]


def labels(paths: Sequence[str]) -> List[str]:
    """Distinct short names of `paths` (see `load_runs`); the same directory twice gets #2, #3."""
    parts = [Path(os.path.abspath(p)).parts[1:] for p in paths]  # without the root

    def depth(mine: tuple) -> int:  # the fewest trailing parts no other directory ends with
        others = [p for p in set(parts) if p != mine]
        d = 1
        while d < len(mine) and any(p[-d:] == mine[-d:] for p in others):
            d += 1
        return d

    names = ["/".join(p[-depth(p):]) for p in parts]
    out = []
    for i, name in enumerate(names):
        n = names[:i].count(name)
        out.append(f"{name} #{n + 1}" if n else name)
    return out


def read_samples(path: Path) -> Dict[int, List[dict]]:
    """samples.jsonl as {iteration: rows}. Each eval writes one block of rows numbered from "row" 0; a resumed run
    writes the blocks of the evals after its checkpoint again, even right after the first (an eval, a crash
    before the next checkpoint, the same eval again): an iteration's last block wins."""
    if not path.is_file():
        return {}
    out: Dict[int, List[dict]] = {}
    previous = None
    for row in read_jsonl(str(path), skip_bad=True):
        it = row.get("iteration") if isinstance(row, dict) else None
        if not isinstance(it, int):
            continue
        if it != previous or row.get("row") == 0:  # a new block replaces an earlier one of its iteration
            out[it] = []
            previous = it
        out[it].append(row)
    return out


@dataclass(frozen=True)
class Finding:
    """The doctor's finding `name` held at iterations `first`..`last` (`count` of them, consecutive in the log)."""

    run: str
    name: str
    first: int
    last: int
    count: int
    message: str


def findings(run: Run) -> List[Finding]:
    """The doctor's findings of a PPO run from its warn/<name> counts (`fired_at`). Consecutive iterations form
    one span (one table row); each span's message quotes the watched metrics at its first and last iteration,
    then what to do."""
    out = []
    for name, hits in fired_at(run).items():
        for first, last, count in _spans(hits, run.series(f"warn/{name}")[0]):
            out.append(Finding(run.label, name, first, last, count, _message(run, name, first, last)))
    return sorted(out, key=lambda f: (f.first, f.name))


def fired_at(run: Run) -> Dict[str, List[int]]:
    """{finding name: the iterations it held}: a cumulative count warn/<name> that rose at iteration i means
    the doctor's condition held at i (the plot's markers)."""
    out: Dict[str, List[int]] = {}
    for key in (k for k in run.keys() if k.startswith("warn/")):
        steps, counts = run.series(key)
        hits = [s for s, c, before in zip(steps, counts, [0.0] + counts) if c > before]
        if hits:
            out[key.split("/", 1)[1]] = hits
    return out


def _spans(fired: List[int], steps: List[int]) -> List[Tuple[int, int, int]]:
    """(first, last, count) of runs of `fired` that are consecutive among the logged `steps`."""
    position = {s: i for i, s in enumerate(steps)}
    spans: List[List[int]] = []
    for s in fired:
        if spans and position[s] == position[spans[-1][-1]] + 1:
            spans[-1].append(s)
        else:
            spans.append([s])
    return [(span[0], span[-1], len(span)) for span in spans]


def _message(run: Run, name: str, first: int, last: int) -> str:
    quoted = []
    for key in WATCHED.get(name, ()):
        values = [f"{run.rows[s][key]:.3g} at {s}" for s in dict.fromkeys((first, last))
                  if isinstance(run.rows[s].get(key), (int, float))]
        if values:
            quoted.append(f"{key} " + ", ".join(values))
    advice = D.ADVICE.get(name, "see the doctor in docs/ppo.md")
    return "; ".join(quoted) + (": " if quoted else "") + advice


def _runs_inside(d: Path) -> str:
    """` (it holds the runs runs/tiny/ppo, ...: name those)` for a parent of runs; empty otherwise."""
    try:
        inside = sorted(p.name for p in d.iterdir() if (p / "metrics.jsonl").is_file())
    except OSError:
        return ""
    return f" (it holds the runs {', '.join(str(d / n) for n in inside)}: name those)" if inside else ""


def _stage_of(config: dict, rows: Dict[int, dict]) -> str:
    """The stage from config.yaml's groups (each stage adds its own), else from the metric keys."""
    for group, stage in (("ppo", "ppo"), ("dpo", "dpo"), ("calibration", "rm")):
        if group in config:
            return stage
    keys = {k for r in rows.values() for k in r}
    if any(k.startswith("ppo/") for k in keys):
        return "ppo"
    if any(k.endswith("/reward_accuracy") for k in keys):
        return "dpo"
    if any(k.endswith("/accuracy") for k in keys):
        return "rm"
    return "sft"


def _checkpoint_root(d: Path, config: dict) -> Optional[Path]:
    """checkpoint.dir as the run saw it, found from here: a relative one under the run's logging.run_dir is
    taken relative to this directory (the report may run from another working directory than the run)."""
    given = (config.get("checkpoint") or {}).get("dir")
    run_dir = (config.get("logging") or {}).get("run_dir")
    if isinstance(given, str) and given:
        g = Path(given)
        if g.is_absolute() or g.exists():
            return g
        if isinstance(run_dir, str) and run_dir and g.parts[: len(Path(run_dir).parts)] == Path(run_dir).parts:
            return d.joinpath(*g.parts[len(Path(run_dir).parts):])
    return d / "checkpoints"


def _parse_yaml(text: Optional[str]) -> dict:
    if not text:
        return {}
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}  # a config.yaml cut off mid-write: the report still shows its text
    return value if isinstance(value, dict) else {}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
