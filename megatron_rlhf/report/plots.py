"""The report's figures: which metrics each stage plots, drawn with matplotlib (Agg) as inline PNG.

::

    figures = stage_figures("ppo", runs)     # [Figure(title, uri="data:image/png;base64,...", legends=[[...]])]

Every figure overlays all `runs` of one stage. With one run the series take the colours; with several, each run
has one colour and each series one line style, and every legend entry names its run (`Figure.legends`: the
labels of each axes' legend, what a test checks). A plot whose metrics no run logged is left out; metrics no
plot names go to one grid of small plots ("Other metrics"), or to the table of single values when a run
logged them once (`single_values`). matplotlib is imported here only, when a report is drawn.
"""

from __future__ import annotations

import base64
import fnmatch
import io
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_rlhf.report.runs import Run, fired_at


@dataclass(frozen=True)
class Plot:
    """One figure: metric keys (fnmatch patterns) on the left axis, optionally others on a twin right axis;
    `findings`: the doctor's findings as vertical markers."""

    title: str
    ylabel: str
    keys: Tuple[str, ...]
    right: Tuple[str, ...] = ()
    right_label: str = ""
    findings: bool = False


@dataclass
class Figure:
    title: str
    uri: str  # data:image/png;base64,...
    legends: List[List[str]]  # per axes, its legend's labels


PPO_PLOTS = (
    Plot("Reward: RM score and held-out true score", "RM score (normalised, z)", ("ppo/rm_score", "eval/rm_score"),
         ("eval/gold_score",), "true score (gold scorer)", findings=True),
    Plot("Held-out greedy decoding: RM score and true score", "RM score (normalised, z)", ("eval/greedy_rm_score",),
         ("eval/greedy_gold_score",), "true score (gold scorer)"),
    Plot("KL to the reference policy", "KL (nats per sequence)", ("ppo/kl_per_seq", "eval/kl")),
    Plot("Response length", "length (tokens)", ("ppo/response_length", "eval/response_length")),
    Plot("Truncation rate (no EOS within max_new_tokens)", "truncated responses (fraction)",
         ("ppo/truncation_rate", "eval/truncation_rate")),
    Plot("Policy loss", "clipped surrogate loss (per token)", ("ppo/policy_loss",)),
    Plot("Value loss", "clipped value loss (per token)", ("ppo/value_loss",)),
    Plot("Clip fractions", "clipped tokens (fraction)", ("ppo/clip_fraction", "ppo/value_clip_fraction")),
    Plot("Policy entropy", "entropy (nats per token)", ("ppo/entropy",)),
    Plot("Rollout-correction weights (trainer / sampler probability)", "ρ (ratio)", ("ppo/rho_*",)),
    Plot("Phase times per iteration", "time (seconds)", ("time/*",)),
    Plot("Peak memory", "memory (GiB)", ("perf/peak_memory_gib*",)),
    Plot("Per-token KL: approximate KL of each update, KL to the reference", "KL (nats per token)",
         ("ppo/approx_kl", "ppo/kl_per_token")),
    Plot("Gradient norms", "gradient norm (L2, before clipping)", ("ppo/*grad_norm",)),
    Plot("Value explained variance", "explained variance (1 = perfect)", ("ppo/value_explained_variance",)),
    Plot("Throughput", "throughput (tokens per second)", ("perf/tokens_per_s",)),
)
SUPERVISED_PLOTS = (  # SFT, RM, DPO
    Plot("Loss", "loss (nats)", ("train/loss", "eval/loss")),
    Plot("Accuracy: pairs ranked right", "accuracy (fraction of pairs)", ("*/accuracy", "*/reward_accuracy")),
    Plot("Margin: chosen − rejected", "margin (reward units)", ("*/score_margin", "*/reward_margin")),
    Plot("DPO implicit rewards", "reward (β · log-ratio, nats)", ("*/chosen_reward", "*/rejected_reward")),
    Plot("Log-probabilities of the answers", "log-probability (nats per answer)", ("*/chosen_logp", "*/rejected_logp")),
    Plot("Learning rate", "learning rate", ("train/lr",)),
    Plot("Gradient norm", "gradient norm (L2, before clipping)", ("train/grad_norm",)),
    Plot("Step time", "time (seconds)", ("time/*",)),
    Plot("Peak memory", "memory (GiB)", ("perf/peak_memory_gib*",)),
    Plot("Throughput", "throughput (tokens per second)", ("perf/tokens_per_s",)),
)
HIDDEN = ("warn/*",)  # the doctor's counts: shown as findings, not as curves
STYLES = ("-", "--", ":", "-.")
FINDING_COLOURS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#ff7f0e")


def plots_of(stage: str) -> Tuple[Plot, ...]:
    return PPO_PLOTS if stage == "ppo" else SUPERVISED_PLOTS


def x_label(stage: str) -> str:
    return "iteration" if stage == "ppo" else "step"


def _matching(patterns: Sequence[str], keys: Sequence[str]) -> List[str]:
    """The keys matching each pattern in turn; within a pattern, the training series before the held-out ones
    (so train/* and ppo/* take the first colours in every figure)."""
    ordered = sorted(keys, key=lambda k: (k.startswith("eval/"), k))
    return [k for p in patterns for k in ordered if fnmatch.fnmatchcase(k, p)]


def stage_figures(stage: str, runs: Sequence[Run]) -> List[Figure]:
    """The figures of one stage's section (see the module docstring)."""
    keys = sorted({k for r in runs for k in r.keys()})
    out, used = [], set(_matching(HIDDEN, keys))
    for plot in plots_of(stage):
        left, right = _matching(plot.keys, keys), _matching(plot.right, keys)
        left, right = [k for k in dict.fromkeys(left) if k not in used], [k for k in right if k not in used]
        used.update(left + right)
        if left or right:
            out.append(_draw(plot, left, right, runs, x_label(stage)))
    rest = [k for k in keys if k not in used and max(_points(r, k) for r in runs) > 1]
    if rest:
        out.append(_grid(rest, runs, x_label(stage)))
    return out


def single_values(stage: str, runs: Sequence[Run]) -> List[Tuple[str, List[str]]]:
    """[(key, the value per run)] of the metrics no plot names that no run logged more than once (e.g. RM
    calibration's eval/reward_calibration_*): a table, not a plot."""
    keys = sorted({k for r in runs for k in r.keys()})
    named = set(_matching(HIDDEN, keys))
    for plot in plots_of(stage):
        named.update(_matching(plot.keys + plot.right, keys))
    rows = []
    for k in keys:
        if k not in named and max(_points(r, k) for r in runs) == 1:
            rows.append((k, [_shown(r.series(k)[1]) for r in runs]))
    return rows


def _points(run: Run, key: str) -> int:
    return len(run.series(key)[0])


def _shown(values: List[float]) -> str:
    return "" if not values else f"{values[-1]:.4g}"


def _new_figure(width: float, height: float, layout: str = "constrained"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), dpi=100, layout=layout)
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    return fig


def _encode(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _line(ax, run: Run, key: str, colour, style: str, label: str) -> None:
    xs, ys = run.series(key)
    sparse = len(xs) <= 30 or key.startswith("eval/")  # evals every N iterations: markers show where
    ax.plot(xs, [y if math.isfinite(y) else float("nan") for y in ys], linestyle=style, color=colour,
            marker="o" if sparse else None, markersize=3.5, linewidth=1.4, label=label)


def _draw(plot: Plot, left: List[str], right: List[str], runs: Sequence[Run], xlabel: str) -> Figure:
    """One figure of `plot`; its legend sits below the axes (it never hides a curve), two entries a row."""
    entries = len(runs) * (len(left) + len(right)) + sum(len(fired_at(r)) for r in runs if plot.findings)
    fig = _new_figure(6.4, 3.3 + 0.17 * ((entries + 1) // 2))
    ax = fig.subplots()
    ax2 = ax.twinx() if right else None
    series = [(ax, k) for k in left] + [(ax2, k) for k in right]
    for r, run in enumerate(runs):
        for s, (axis, key) in enumerate(series):
            colour, style = (f"C{s % 10}", "-") if len(runs) == 1 else (f"C{r % 10}", STYLES[s % len(STYLES)])
            name = key + (" (right axis)" if axis is ax2 else "")
            _line(axis, run, key, colour, style, name if len(runs) == 1 else f"{run.label}: {name}")
        if plot.findings:
            _mark_findings(ax, run, len(runs) > 1)
    ax.set_title(plot.title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if ax2 is not None:
        ax2.set_ylabel(plot.right_label)
        more = ax2.get_legend_handles_labels()
        handles, names = handles + more[0], names + more[1]
    legend = fig.legend(handles, names, fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    return Figure(plot.title, _encode(fig), [[t.get_text() for t in legend.get_texts()]])


def _mark_findings(ax, run: Run, name_run: bool) -> None:
    """A vertical line at each iteration a doctor finding held; one legend entry per finding (and run)."""
    from megatron_rlhf.trainer.ppo.doctor import NAMES

    for name, iterations in fired_at(run).items():
        colour = FINDING_COLOURS[(NAMES.index(name) if name in NAMES else len(NAMES)) % len(FINDING_COLOURS)]
        label = f"doctor: {name}" + (f" ({run.label})" if name_run else "")
        for i, it in enumerate(iterations):
            ax.axvline(it, color=colour, alpha=0.55, linewidth=1.2, linestyle="--", label=label if i == 0 else None)


def _grid(keys: List[str], runs: Sequence[Run], xlabel: str) -> Figure:
    """Small plots of the metrics no figure names, four to a row; each has its own legend."""
    cols = 4
    rows = (len(keys) + cols - 1) // cols
    fig = _new_figure(12.8, 2.5 * rows + 0.4, layout="tight")
    axes = fig.subplots(rows, cols, squeeze=False)
    legends = []
    for i, ax in enumerate(axes.flat):
        if i >= len(keys):
            ax.set_visible(False)
            continue
        for r, run in enumerate(runs):
            _line(ax, run, keys[i], f"C{r % 10}", "-", run.label)
        ax.set_title(keys[i], fontsize=8)
        ax.set_xlabel(xlabel, fontsize=7)
        ax.set_ylabel("value", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
        legend = ax.legend(fontsize=6, loc="best")
        legends.append([t.get_text() for t in legend.get_texts()])
    fig.suptitle("Other metrics (as logged; units as their names say)", fontsize=10)
    return Figure("Other metrics", _encode(fig), legends)

