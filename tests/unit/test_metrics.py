"""Rank-0 metrics: TensorBoard tags and values, jsonl copy, timers, config text, no-op on other ranks."""

import os
import time

import pytest
import torch

from megatron_rlhf.parallel.cpu import peak_memory_gib
from megatron_rlhf.trainer.metrics import MetricsLogger, read_jsonl


def events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    return acc


def test_tensorboard_and_jsonl_hold_the_namespaced_scalars(tmp_path):
    run = str(tmp_path / "run")
    losses = [2.0, 1.5, 1.25]
    with MetricsLogger(run, total_steps=3, config_text="train:\n  lr: 0.001", progress_bar=False) as m:
        for step, loss in enumerate(losses, 1):
            with m.timer("time/forward"):
                time.sleep(0.002)
            m.log(step, {"train/loss": torch.tensor(loss), "train/lr": 1e-3 * step, "perf/tokens_per_s": 100 * step})
        m.log(3, {"eval/accuracy": 0.75, "perf/peak_mem_gib": peak_memory_gib()})
    acc = events(run)
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "time/forward", "eval/accuracy", "perf/peak_mem_gib"} <= scalars
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert acc.Scalars("eval/accuracy")[0].step == 3
    assert all(e.value >= 0.002 for e in acc.Scalars("time/forward"))
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr: 0.001" in text
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert [r["train/loss"] for r in rows[:3]] == losses
    assert rows[3]["eval/accuracy"] == 0.75 and "train/loss" not in rows[3]


def test_timer_reports_seconds_per_step_since_the_last_log(tmp_path):
    m = MetricsLogger(str(tmp_path), progress_bar=False, tensorboard=False)
    spent = 0.0
    for _ in range(2):  # two steps, logged once
        with m.timer("time/step") as t:
            time.sleep(0.003)
        spent += t.seconds
    m.log(2, {})
    m.close()
    row = read_jsonl(str(tmp_path / "metrics.jsonl"))[0]
    assert row["time/step"] == pytest.approx(spent / 2)


def test_disabled_logger_writes_nothing(tmp_path):
    run = tmp_path / "rank1"
    m = MetricsLogger(str(run), enabled=False, total_steps=5, config_text="x")
    m.start(2)
    with m.timer("time/x"):
        pass
    m.log(3, {"train/loss": 1.0})
    m.log_text("config", "x")
    m.write("hello")
    m.close()
    assert not run.exists()


def test_names_need_a_known_namespace(tmp_path):
    m = MetricsLogger(str(tmp_path), progress_bar=False, tensorboard=False)
    for bad in ("loss", "training/loss", "train/"):
        with pytest.raises(ValueError, match="namespace"):
            m.log(1, {bad: 1.0})
    with pytest.raises(ValueError, match="one element"):
        m.log(1, {"train/loss": torch.ones(2)})
    m.close()
    other = MetricsLogger(str(tmp_path / "b"), progress_bar=False, tensorboard=False, namespaces=("rollout",))
    other.log(1, {"rollout/kl": 0.1})
    other.close()


def test_resume_purges_later_events_and_appends_jsonl(tmp_path, capsys):
    run = str(tmp_path)
    with MetricsLogger(run, total_steps=6, progress_bar=True) as m:
        for step in range(1, 6):
            m.log(step, {"train/loss": float(step)})
    # a crash after step 5, resumed from the checkpoint at step 3
    with MetricsLogger(run, total_steps=6, progress_bar=True) as m:
        m.start(3)
        for step in (4, 5, 6):
            m.log(step, {"train/loss": 10.0 + step})
    assert "6/6" in capsys.readouterr().err  # the bar reached the end
    values = {e.step: e.value for e in events(run).Scalars("train/loss")}
    assert values == {1: 1.0, 2: 2.0, 3: 3.0, 4: 14.0, 5: 15.0, 6: 16.0}
    assert len(read_jsonl(os.path.join(run, "metrics.jsonl"))) == 8


def test_log_interval_writes_every_nth_step_and_the_last(tmp_path):
    run = str(tmp_path / "run")
    with MetricsLogger(run, total_steps=7, progress_bar=False, tensorboard=False, log_interval=3) as m:
        written = [m.log_step(step, {"train/loss": float(step)}, last=step == 7) for step in range(1, 8)]
    assert written == [False, False, True, False, False, True, True]
    assert [r["step"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))] == [3, 6, 7]


def test_progress_bar_shows_this_steps_loss_not_the_previous_ones(tmp_path, capsys):
    with MetricsLogger(str(tmp_path / "run"), total_steps=3, tensorboard=False) as m:
        m.log(1, {"train/loss": 5.0})
        # Redraw on every move (tqdm otherwise skips redraws within 0.1 s or a few steps).
        m._bar.mininterval, m._bar.miniters, m._bar.dynamic_miniters = 0, 0, False
        for step, loss in ((2, 3.0), (3, 1.0)):
            m.log(step, {"train/loss": loss})
            drawn = [part for part in capsys.readouterr().err.split("\r") if part.strip()][-1]
            assert f"{step}/3" in drawn and f"loss={loss:.4g}" in drawn, drawn
