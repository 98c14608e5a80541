"""The report page: one self-contained HTML file (inline CSS and PNG, no script, nothing fetched), rendered with
Jinja2 from the runs. One section per stage present (pipeline order); inside it every plot overlays the runs.

::

    html, figures = render(runs)     # figures: {stage: [plots.Figure]} (their legends, for checks)

A PPO section adds the doctor's findings (iteration spans, finding, message), the held-out samples of the
first and last evaluation (samples.jsonl), and the top-level *.json summaries as tables; every section ends
with each run's config.yaml (collapsed) and its latest checkpoint.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rlhf.report import plots
from megatron_rlhf.report.runs import STAGES, Run, findings

STAGE_TITLES = {"sft": "Stage 1: SFT", "rm": "Stage 2: reward model", "ppo": "Stage 3: PPO", "dpo": "DPO"}

TEMPLATE = """{% macro table(t) %}<h3>{{ t.title }}</h3>
{% if t.note %}<p class="muted">{{ t.note }}</p>{% endif %}
<table>
<tr>{% for h in t.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td{% if c.cls %} class="{{ c.cls }}"{% endif %}>{{ c.text }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% endmacro %}<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{ title }}</title>
<style>
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; }
h2 { font-size: 18px; border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 28px; }
h3 { font-size: 15px; margin-top: 22px; }
.muted { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 12px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.mono, pre, code { font-family: Menlo, Consolas, monospace; font-size: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 8px; }
.grid figure { margin: 0; } .grid figure.wide { grid-column: 1 / -1; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
details { margin: 4px 0; } summary { cursor: pointer; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; max-height: 480px; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<p class="muted">written {{ written }} by <code>megatron-rlhf report</code></p>
{{ table(overview) }}
{% for s in sections %}
<section id="{{ s.stage }}">
<h2>{{ s.title }}</h2>
{% for t in s.tables %}{{ table(t) }}{% endfor %}
<h3>Plots</h3>
{% if s.figures %}<div class="grid">
{% for f in s.figures %}<figure{% if f.title == "Other metrics" %} class="wide"{% endif %}>\
<img src="{{ f.uri }}" alt="{{ f.title }}" title="{{ f.title }}"></figure>
{% endfor %}</div>{% else %}<p class="muted">no metrics logged yet</p>{% endif %}
{% for t in s.after %}{{ table(t) }}{% endfor %}
<h3>Configs and checkpoints</h3>
{% for r in s.runs %}<details><summary>{{ r.label }}: config.yaml; \
{% if r.checkpoint %}latest checkpoint <code>{{ r.checkpoint }}</code>{% else %}no checkpoint yet\
{% if r.checkpoint_root %} under <code>{{ r.checkpoint_root }}</code>{% endif %}{% endif %}</summary>
<pre>{{ r.config_text or "(no config.yaml)" }}</pre></details>
{% endfor %}</section>
{% endfor %}
</body>
</html>
"""


class Cell:
    """A table cell: text (escaped by the template) and a CSS class (num, mono)."""

    def __init__(self, value, cls: str = ""):
        if isinstance(value, float):
            self.text, self.cls = f"{value:.4g}", cls or "num"
        elif value is None:
            self.text, self.cls = "", cls
        else:
            self.text, self.cls = str(value), cls

    def __repr__(self) -> str:
        return f"Cell({self.text!r})"


class Table:
    def __init__(self, title: str, header: Sequence[str], rows: List[List[Cell]], note: str = ""):
        self.title, self.header, self.rows, self.note = title, list(header), rows, note


def overview_table(runs: Sequence[Run]) -> Table:
    rows = [[Cell(r.label), Cell(r.stage), Cell(r.path, "mono"), Cell(r.status()), Cell(r.checkpoint or "none yet", "mono")]
            for r in runs]
    return Table("Runs", ["run", "stage", "directory", "status", "latest checkpoint"], rows)


def summary_table(runs: Sequence[Run]) -> Optional[Table]:
    """The runs' top-level *.json files (summary.json, reward_calibration.json): one row per scalar key."""
    files = sorted({name for r in runs for name in r.jsons})
    rows = []
    for name in files:
        keys = list(dict.fromkeys(k for r in runs for k, v in r.jsons.get(name, {}).items()
                                  if v is None or isinstance(v, (int, float, str, bool))))
        for key in keys:
            rows.append([Cell(name, "mono"), Cell(key, "mono")] + [Cell(r.jsons.get(name, {}).get(key)) for r in runs])
    if not rows:
        return None
    return Table("Summaries", ["file", "key"] + [r.label for r in runs], rows)


def findings_table(runs: Sequence[Run]) -> Table:
    rows = []
    for r in runs:
        for f in findings(r):
            span = str(f.first) if f.first == f.last else f"{f.first}–{f.last} ({f.count} iterations)"
            rows.append(([Cell(f.run)] if len(runs) > 1 else []) + [Cell(span), Cell(f.name, "mono"), Cell(f.message)])
    if not rows:
        rows = [([Cell("")] if len(runs) > 1 else []) + [Cell(""), Cell("none"), Cell("the doctor found nothing")]]
    header = (["run"] if len(runs) > 1 else []) + ["iteration", "finding", "message"]
    return Table("Doctor's findings", header, rows, note="marked on the reward plot as dashed vertical lines")


def samples_tables(runs: Sequence[Run]) -> List[Table]:
    """Per run with samples: the first and last evaluation side by side when they sampled the same prompts
    (the PPO eval always does), else one table per evaluation."""
    out = []
    for r in runs:
        if not r.samples:
            continue
        first, last = min(r.samples), max(r.samples)
        a, b = r.samples[first], r.samples[last]
        owner = f" ({r.label})" if len(runs) > 1 else ""
        if first != last and [x.get("prompt") for x in a] == [x.get("prompt") for x in b]:
            header = ["prompt", f"response at {first}", "RM", "true", f"response at {last}", "RM", "true"]
            rows = [[Cell(x.get("prompt"), "mono"), *_sample_cells(x), *_sample_cells(y)] for x, y in zip(a, b)]
            out.append(Table(f"Held-out samples: iteration {first} and {last}{owner}", header, rows,
                             note="RM: reward-model score (normalised); true: the gold scorer's score"))
            continue
        for it in dict.fromkeys((first, last)):
            rows = [[Cell(x.get("prompt"), "mono"), *_sample_cells(x)] for x in r.samples[it]]
            out.append(Table(f"Held-out samples: iteration {it}{owner}", ["prompt", "response", "RM", "true"], rows))
    return out


def _sample_cells(row: dict) -> List[Cell]:
    return [Cell(row.get("response"), "mono"), Cell(_number(row.get("rm_score"))), Cell(_number(row.get("gold_score")))]


def _number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def single_values_table(stage: str, runs: Sequence[Run]) -> Optional[Table]:
    rows = [[Cell(k, "mono")] + [Cell(v, "num") for v in values] for k, values in plots.single_values(stage, runs)]
    return Table("Metrics logged once", ["metric"] + [r.label for r in runs], rows) if rows else None


class Section:
    def __init__(self, stage: str, runs: List[Run]):
        self.stage, self.runs = stage, runs
        self.title = f"{STAGE_TITLES.get(stage, stage)} — " + ", ".join(r.label for r in runs)
        self.figures = plots.stage_figures(stage, runs)
        self.tables = [t for t in (summary_table(runs),) if t is not None]
        if stage == "ppo":
            self.tables.append(findings_table(runs))
        self.after = samples_tables(runs) + [t for t in (single_values_table(stage, runs),) if t is not None]


def render(runs: Sequence[Run], title: Optional[str] = None) -> Tuple[str, Dict[str, List[plots.Figure]]]:
    """(the page, {stage: its figures})."""
    import jinja2

    by_stage = {s: [r for r in runs if r.stage == s] for s in STAGES}
    sections = [Section(s, rs) for s, rs in by_stage.items() if rs]
    title = title or "Run report: " + ", ".join(r.label for r in runs)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=False)
    page = env.from_string(TEMPLATE).render(title=title, overview=overview_table(runs), sections=sections,
                                            written=time.strftime("%Y-%m-%d %H:%M:%S"))
    return page, {s.stage: s.figures for s in sections}
