"""`megatron-rlhf report` (megatron_rlhf/report/) on run directories written here with the keys real runs log.

The PPO run below is shaped like a short tiny-task run that resumed once (rows of iterations 7-8 appended again)
and was reward-hacked: the RM score rises while the held-out true score falls, and the doctor's counts rise. The
page must be valid, self-contained HTML with one image per plot, the findings and the samples; a real browser
(Debian's headless Chromium) must open it without a console message and paint more than a blank page.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from megatron_rlhf import cli
from megatron_rlhf.report import runs as R
from megatron_rlhf.report.command import default_out, write_report
from megatron_rlhf.report.page import render
from megatron_rlhf.trainer.metrics import read_jsonl

ITERATIONS, EVAL_EVERY = 12, 4
PROMPTS = ["sort 7 2 6 5 =", "sort 4 0 5 2 9 4 =", "sort 3 3 3 6 ="]


def _write_jsonl(path: Path, rows) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _ppo_row(it: int, hacked: bool, shift: float = 0.0) -> dict:
    row = {"step": it, "wall_time": 1.7e9 + it}
    if it > 0:
        row.update({f"ppo/{k}": v for k, v in {
            "rm_score": 0.1 * it + shift, "score": 0.1 * it, "kl_per_seq": 0.2 * it, "kl_per_token": 0.03 * it,
            "approx_kl": 0.01, "clip_fraction": 0.3 if 3 <= it <= 5 else 0.05, "value_clip_fraction": 0.02,
            "entropy": 0.9 - 0.02 * it, "response_length": 5 + 0.1 * it, "truncation_rate": 0.05,
            "policy_loss": -0.01 * math.cos(it), "value_loss": 0.3 / it, "policy_grad_norm": 1.8, "value_grad_norm": 0.2,
            "value_explained_variance": 0.05 * it, "return_mean": 0.1, "ratio": 1.0, "ratio_first_minibatch": 1.0,
            "beta": 0.05, "rho_mean": 1.0, "rho_max": 1.02, "rho_abs_dev": 1e-4, "skipped_steps": 0.0}.items()})
        row.update({"time/rollout": 0.15, "time/score": 0.03, "time/advantages": 0.01, "time/train": 0.1,
                    "time/iteration": 0.3, "perf/peak_memory_gib": 0.56, "perf/peak_memory_gib/rollout": 0.55,
                    "perf/tokens_per_iteration": 880.0, "perf/tokens_per_s": 5500.0})
        counts = {"clip_fraction": sum(3 <= i <= min(it, 5) for i in range(1, it + 1)),
                  "reward_hacking": sum(i % EVAL_EVERY == 0 and i >= 8 for i in range(1, it + 1)) if hacked else 0}
        row.update({f"warn/{n}": float(counts.get(n, 0)) for n in ("kl_blowup", "clip_fraction", "reward_hacking")})
    if it % EVAL_EVERY == 0:
        gold = 0.6 - (0.01 * it if hacked else -0.02 * it)
        row.update({"eval/rm_score": -0.3 + 0.05 * it, "eval/gold_score": gold, "eval/kl": 0.1 * it,
                    "eval/response_length": 5.0, "eval/truncation_rate": 0.02, "eval/greedy_rm_score": 0.0,
                    "eval/greedy_gold_score": 0.5})
    return row


def make_ppo_run(d: Path, hacked: bool = True) -> Path:
    """A finished PPO run dir: metrics (resumed at 6: 7-8 logged twice, the second time with other RM scores),
    config.yaml, summary.json, samples.jsonl (evals 0, 4, 8, 12; iteration 8's block written twice) and
    checkpoints/latest -> step_00000012 with its run.json."""
    d.mkdir(parents=True)
    _write_jsonl(d / "metrics.jsonl", [_ppo_row(i, hacked, shift=9.0) for i in range(0, 9)])
    _write_jsonl(d / "metrics.jsonl", [_ppo_row(i, hacked) for i in range(7, ITERATIONS + 1)])
    config = {"model": {"load": "runs/tiny/sft/checkpoints"}, "train": {"lr": 1e-4},
              "ppo": {"iterations": ITERATIONS, "eval_interval": EVAL_EVERY}, "logging": {"run_dir": "runs/x/ppo"},
              "checkpoint": {"dir": "runs/x/ppo/checkpoints", "save_interval": 6}}
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (d / "summary.json").write_text(json.dumps({"true_reward_sft": 0.6, "true_reward_ppo": 0.48, "kl_ppo": None,
                                                "iterations": ITERATIONS}))
    for it, tag in ((0, "a"), (4, "b"), (8, "stale"), (8, "c"), (12, "d")):
        _write_jsonl(d / R.SAMPLES_FILE, [{"iteration": it, "row": i, "prompt": p, "response": f"{tag}{i} <eos>",
                                           "rm_score": 0.1 * it, "gold_score": 1.0 - 0.05 * it}
                                          for i, p in enumerate(PROMPTS)])
    step = d / "checkpoints" / "step_00000012"
    step.mkdir(parents=True)
    (step / "run.json").write_text(json.dumps({"stage": "ppo", "run_id": "abc"}))
    (d / "checkpoints" / "latest").write_text("step_00000012")
    return d


def make_supervised_run(d: Path, stage: str) -> Path:
    """An SFT, RM or DPO run dir (train rows every 5 steps, eval rows at 10 and 20 as separate rows of the
    same step, as the loop logs them), config.yaml with the stage's own group, no checkpoint."""
    d.mkdir(parents=True)
    extra = {"rm": {"accuracy": 0.7, "score_margin": 0.1},
             "dpo": {"reward_accuracy": 0.6, "reward_margin": 0.2, "chosen_reward": 0.1, "rejected_reward": -0.1,
                     "chosen_logp": -5.0, "rejected_logp": -6.0}}.get(stage, {})
    rows = []
    for s in range(5, 25, 5):
        rows.append({"step": s, "wall_time": 0.0, "train/loss": 2.0 / s, "train/lr": 1e-3, "train/grad_norm": 1.5,
                     "train/skipped": 0.0, "time/step": 0.05, "perf/tokens_per_s": 2e4, "perf/peak_memory_gib": 0.57,
                     **{f"train/{k}": v for k, v in extra.items()}})
        if s % 10 == 0:
            rows.append({"step": s, "wall_time": 0.0, "eval/loss": 1.0 / s, **{f"eval/{k}": v for k, v in extra.items()}})
    if stage == "rm":
        rows.append({"step": 20, "wall_time": 0.0, "eval/reward_calibration_mean": 0.15})
    _write_jsonl(d / "metrics.jsonl", rows)
    groups = {"rm": {"calibration": {"enabled": True}}, "dpo": {"dpo": {"beta": 0.1}}}.get(stage, {})
    (d / "config.yaml").write_text(yaml.safe_dump({"train": {"train_steps": 20}, **groups}))
    return d


class StrictHTML(HTMLParser):
    """Every element closed in order (void elements excepted); collects each tag's attributes."""

    VOID = {"meta", "img", "br", "hr", "link", "input", "col", "source", "wbr", "area", "base", "embed"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.tags, self.errors, self.doctype = [], [], [], None

    def handle_decl(self, decl):
        self.doctype = decl

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} at {self.getpos()}")
        else:
            self.stack.pop()


def parse(page: str) -> StrictHTML:
    p = StrictHTML()
    p.feed(page)
    p.close()
    assert p.doctype and p.doctype.lower() == "doctype html"
    assert p.errors == [] and p.stack == [], (p.errors, p.stack)
    return p


# The plots issue 49 names, by a word of their titles (each must be one <img>).
PPO_PLOTS = ("Reward: RM score and held-out true score", "KL to the reference policy", "Response length",
             "Truncation rate", "Policy loss", "Value loss", "Clip fractions", "Policy entropy",
             "Rollout-correction weights", "Phase times per iteration", "Peak memory")


def _check_self_contained(page: str, p: StrictHTML) -> None:
    for tag, attrs in p.tags:
        for name in ("src", "href"):
            if name in attrs:
                assert attrs[name].startswith(("data:", "#")), (tag, attrs[name][:80])
    assert "http://" not in page and "https://" not in page and 'src="//' not in page and 'href="//' not in page
    assert "<script" not in page


def test_ppo_report_is_valid_self_contained_html_with_each_plot_findings_and_samples(tmp_path):
    run = make_ppo_run(tmp_path / "ppo")
    out = write_report([str(run)])
    assert out == str(run / "report.html")
    page = Path(out).read_text()
    p = parse(page)
    _check_self_contained(page, p)
    images = [a["alt"] for t, a in p.tags if t == "img"]
    for title in PPO_PLOTS:
        assert sum(alt.startswith(title) for alt in images) == 1, (title, images)
    assert all(a["src"].startswith("data:image/png;base64,") for t, a in p.tags if t == "img")
    # The doctor's findings: clip_fraction held at 3-5 (one span), reward hacking at evals 8 and 12.
    assert "3–5 (3 iterations)" in page and "reward_hacking" in page
    assert "eval/gold_score 0.52 at 8" in page and "raise ppo.beta" in page
    # Samples of the first and last eval side by side (prompts escaped, <eos> shown as text).
    assert "Held-out samples: iteration 0 and 12" in page and "a0 &lt;eos&gt;" in page and "d2 &lt;eos&gt;" in page
    assert "stale" not in page  # iteration 8's block written again by the resumed run replaced the first
    # The config (collapsed) and the latest checkpoint; checkpoint.dir relative to the run's cwd maps to here.
    assert "<details>" in page and "eval_interval: 4" in page
    assert str(run / "checkpoints" / "step_00000012") in page
    assert "last logged iteration 12 of 12; finished (summary.json written)" in page


def test_the_reward_plot_has_both_rewards_on_twin_axes_and_the_findings_as_markers(tmp_path):
    runs = R.load_runs([str(make_ppo_run(tmp_path / "ppo"))])
    _, figures = render(runs)
    reward = next(f for f in figures["ppo"] if f.title.startswith("Reward"))
    assert reward.legends == [["ppo/rm_score", "eval/rm_score", "doctor: clip_fraction", "doctor: reward_hacking",
                               "eval/gold_score (right axis)"]]


def test_resumed_rows_merge_per_step_and_the_later_value_wins(tmp_path):
    run = R.load_run(str(make_ppo_run(tmp_path / "ppo")))
    assert run.stage == "ppo" and run.steps == list(range(ITERATIONS + 1))
    xs, ys = run.series("ppo/rm_score")
    assert ys[xs.index(8)] == pytest.approx(0.8) and ys[xs.index(6)] == pytest.approx(9.6)  # 6 only from the first
    assert sorted(run.samples) == [0, 4, 8, 12] and run.samples[8][0]["response"] == "c0 <eos>"
    assert [(f.name, f.first, f.last, f.count) for f in R.findings(run)] == [
        ("clip_fraction", 3, 5, 3), ("reward_hacking", 8, 8, 1), ("reward_hacking", 12, 12, 1)]


def test_two_runs_overlay_with_both_labels_in_every_legend(tmp_path):
    a, b = make_ppo_run(tmp_path / "good" / "ppo", hacked=False), make_ppo_run(tmp_path / "hacked" / "ppo")
    runs = R.load_runs([str(a), str(b)])
    assert [r.label for r in runs] == ["good/ppo", "hacked/ppo"]
    page, figures = render(runs)
    assert len(figures["ppo"]) >= len(PPO_PLOTS)
    for figure in figures["ppo"]:
        for legend in figure.legends:
            for label in ("good/ppo", "hacked/ppo"):
                assert any(t == label or t.startswith(label + ":") for t in legend), (figure.title, label, legend)
    p = parse(page)
    assert sum(t == "img" for t, _ in p.tags) == len(figures["ppo"])  # one section, the runs overlaid
    assert default_out([str(a), str(b)]) == str(tmp_path / "report.html")


@pytest.mark.parametrize("stage,titles", [
    ("sft", ("Loss", "Learning rate", "Gradient norm", "Step time", "Peak memory", "Throughput")),
    ("rm", ("Loss", "Accuracy: pairs ranked right", "Margin: chosen − rejected", "Learning rate", "Gradient norm")),
    ("dpo", ("Loss", "Accuracy: pairs ranked right", "Margin: chosen − rejected", "DPO implicit rewards",
             "Log-probabilities of the answers")),
])
def test_supervised_stages_plot_losses_accuracies_margins_lr_and_times(tmp_path, stage, titles):
    run = make_supervised_run(tmp_path / stage, stage)
    page = Path(write_report([str(run)])).read_text()
    p = parse(page)
    images = [a["alt"] for t, a in p.tags if t == "img"]
    assert set(titles) <= set(images), images
    assert R.load_run(str(run)).stage == stage
    xs, _ = R.load_run(str(run)).series("train/loss")
    assert xs == [5, 10, 15, 20]  # the eval rows of steps 10 and 20 merged into the train rows, not over them
    if stage == "rm":
        assert "Metrics logged once" in page and "eval/reward_calibration_mean" in page
    assert "no checkpoint yet" in page and "last logged step 20 of 20" in page


def test_all_stages_on_one_page_in_pipeline_order(tmp_path):
    dirs = [make_ppo_run(tmp_path / "ppo"), make_supervised_run(tmp_path / "sft", "sft"),
            make_supervised_run(tmp_path / "rm", "rm")]
    out = tmp_path / "report.html"
    write_report([str(d) for d in dirs], str(out))
    page = out.read_text()
    parse(page)
    sections = [page.index(f'<section id="{s}">') for s in ("sft", "rm", "ppo")]
    assert sections == sorted(sections)


def test_stage_from_the_checkpoint_record_then_the_config_then_the_metrics(tmp_path):
    d = make_supervised_run(tmp_path / "x", "sft")
    assert R.load_run(str(d)).stage == "sft"
    (d / "config.yaml").unlink()
    _write_jsonl(d / "metrics.jsonl", [{"step": 25, "wall_time": 0.0, "train/accuracy": 0.5}])
    assert R.load_run(str(d)).stage == "rm"  # no config: the keys say RM
    step = d / "checkpoints" / "step_00000020"
    step.mkdir(parents=True)
    (step / "run.json").write_text(json.dumps({"stage": "dpo", "run_id": "r"}))
    (d / "checkpoints" / "latest").write_text("step_00000020\n")
    run = R.load_run(str(d))
    assert run.stage == "dpo" and run.checkpoint == step
    (d / "checkpoints" / "latest").write_text("step_00000030")  # a pointer to nothing: no checkpoint, no stage
    run = R.load_run(str(d))
    assert run.checkpoint is None and run.stage == "rm"


def test_a_running_or_diverged_run_reports_what_it_has(tmp_path):
    d = tmp_path / "ppo"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:  # NaN as json.dumps writes it, then a line cut off mid-write
        f.write(json.dumps(_ppo_row(0, False)) + "\n" + json.dumps(_ppo_row(1, False)) + "\n")
        f.write(json.dumps({**_ppo_row(2, False), "ppo/kl_per_seq": float("nan"), "ppo/policy_loss": None}) + "\n")
        f.write('{"step": 3, "ppo/rm_sc')
    with pytest.raises(ValueError):
        read_jsonl(str(d / "metrics.jsonl"))  # the cut-off line; the report skips it (skip_bad)
    page = Path(write_report([str(d)])).read_text()
    parse(page)
    assert "last logged iteration 2; non-finite values from iteration 2 (ppo/kl_per_seq, ppo/policy_loss): diverged" \
        in page
    assert "no checkpoint yet" in page and "(no config.yaml)" in page


def test_a_directory_that_is_no_run_is_one_line_and_exit_2(tmp_path, capsys):
    make_ppo_run(tmp_path / "ppo")
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path} is not a run directory (no metrics.jsonl): give a stage's logging.run_dir "
                   f"(it holds the runs {tmp_path / 'ppo'}: name those)"]
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'nowhere'} is not a run directory (no "
                                               "metrics.jsonl): give a stage's logging.run_dir")


def test_the_command_writes_the_page_and_prints_its_path(tmp_path, capsys):
    run = make_ppo_run(tmp_path / "ppo")
    assert cli.main(["report", str(run), "--out", str(tmp_path / "out" / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'out' / 'r.html'}"
    assert (tmp_path / "out" / "r.html").stat().st_size > 10_000


# ------------------------------------------------------------------------------------------------------------
# A real browser: Debian's headless Chromium (.ci/run installs it, as it installs Slurm).

def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium is not installed and this is not root with apt-get: apt-get install chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run("apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium", shell=True,
                   check=True, env=env, timeout=900, capture_output=True)
    return shutil.which("chromium")


def open_in_chromium(page: Path, shot: Path, profile: Path) -> list:
    """Screenshot `page` at 1280x2000; returns the console messages the page caused (Chromium logs each as
    `INFO:CONSOLE:<line>] "<message>", source: <url>`; an uncaught exception as "Uncaught ...")."""
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1280,2000",
         page.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_the_report_opens_in_chromium_without_console_errors_and_is_not_blank(tmp_path):
    import matplotlib.image
    import numpy as np

    bad = tmp_path / "bad.html"  # the check can fail: a page that logs an error and throws
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><script>console.error("boom");'
                   'throw new Error("bang");</script></body></html>')
    messages = open_in_chromium(bad, tmp_path / "bad.png", tmp_path / "profile-bad")
    assert any('"boom"' in m for m in messages) and any("Uncaught Error: bang" in m for m in messages), messages

    out = Path(write_report([str(make_ppo_run(tmp_path / "ppo"))]))
    shot = tmp_path / "report.png"
    assert open_in_chromium(out, shot, tmp_path / "profile") == []
    pixels = matplotlib.image.imread(str(shot))[..., :3]  # [2000, 1280, 3] floats in 0..1
    assert pixels.shape[:2] == (2000, 1280)
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200 and pixels.std() > 0.05, (len(colours), pixels.std())  # plots, not a blank page
    # The plots are painted, not only the tables: the lower half (below the tables) holds coloured pixels.
    lower = pixels[1000:]
    assert ((lower.max(-1) - lower.min(-1)) > 0.3).mean() > 0.005
