"""Stages 1-2 end to end on CPU: SFT and RM learn, TensorBoard tags, exact resume (the RM at PP=2;
SFT at TP=2 in test_vocab_padding.py), kill -9 during a save, and SIGTERM -> checkpoint -> exit 0 -> resume."""

import json
import os
import sys

import pytest

from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import CLI, child_env, free_port, read_json, run_reaped, sigterm_when, torchrun
from tests.distributed.stages import losses, overrides, run_cli


def test_sft_loss_falls_and_tensorboard_tags(data, tmp_path):
    run = tmp_path / "sft"
    run_cli("sft", overrides(data, run, **{"train.train_steps": 40, "train.global_batch_size": 16,
                                           "checkpoint.save_interval": 0, "train.eval_interval": 20}))
    curve = losses(run)
    assert len(curve) == 40
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (38, 39, 40)) / 3
    assert last < 0.75 * first, (first, last)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "time/step", "perf/tokens_per_step"):
        assert tag in tags, (tag, sorted(tags))
    assert (run / "config.yaml").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000040"


def test_rm_learns_a_known_rule(data, tmp_path):
    run = tmp_path / "rm"
    run_cli("rm", overrides(data, run, "rm", **{"train.train_steps": 60, "train.global_batch_size": 16,
                                                "checkpoint.save_interval": 0}))
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals, rows[-1]
    assert evals[-1]["eval/accuracy"] > 0.85, evals[-1]
    # A run that goes on from this RM (model.load) starts from its head too, not a fresh one (accuracy ~0.5)
    more = tmp_path / "rm_more"
    run_cli("rm", overrides(data, more, "rm", **{"model.load": run / "checkpoints", "train.train_steps": 1,
                                                 "train.lr": 1e-9, "train.global_batch_size": 16}))
    again = [r for r in read_jsonl(os.path.join(more, "metrics.jsonl")) if "eval/accuracy" in r]
    assert abs(again[-1]["eval/accuracy"] - evals[-1]["eval/accuracy"]) < 0.02, (again[-1], evals[-1])


# One rank: test_kill_9_during_save_keeps_previous_checkpoint; SFT at TP=2: test_vocab_padding.py.
# bf16: Megatron's mixed-precision optimizer saves fp32 main parameters and Adam moments beside the bf16
# model; an exact resume shows both came back (the plain and the distributed optimizer keep them apart).
@pytest.mark.parametrize("kind, nproc, extra", [
    ("rm", 2, {"parallel.pp": 2}),
    ("sft", 2, {"model.params_dtype": "bfloat16"}),
    ("sft", 2, {"model.params_dtype": "bfloat16", "parallel.use_distributed_optimizer": "true"}),
], ids=["rm-pp2", "sft-bf16", "sft-bf16-distopt"])
def test_resume_is_exact(data, tmp_path, kind, nproc, extra):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_cli(kind, overrides(data, straight, kind, **extra), nproc=nproc)
    run_cli(kind, overrides(data, split, kind, **extra, **{"train.exit_at_step": 3}), nproc=nproc)
    assert losses(split).keys() == {1, 2, 3}
    run_cli(kind, overrides(data, split, kind, **extra), nproc=nproc)
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit-exact on CPU


def test_sequence_parallel_trains_as_without_it(data, tmp_path):
    """The RM (a scalar head on the gathered sequence) at TP=2 with sequence parallelism on the local spec, padded:
    the losses and eval accuracy of a run without it (within fp32 rounding: the norms' weight gradients are summed
    over TP ranks in another order). Every other rejected response is one digit longer, so micro-batch widths of
    both parities occur and round up to the TP size. Packed SP runs in test_dpo's TP=2 run and test_packing."""
    pairs = [json.loads(line) for line in (data / "pairs.jsonl").read_text().splitlines()]
    for i, pair in enumerate(pairs):
        pair["rejected"] += " 9" * (i % 2)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    tp2 = {"parallel.tp": 2, "train.packing": "false", "train.eval_interval": 3, "train.micro_batch_size": 1,
           "data.train_path": tmp_path / "pairs.jsonl", "checkpoint.save_interval": 0}
    runs = {name: tmp_path / name for name in ("plain", "sp")}
    run_cli("rm", overrides(data, runs["plain"], "rm", **tp2), nproc=2)
    run_cli("rm", overrides(data, runs["sp"], "rm", **tp2, **{"parallel.sequence_parallel": "true"}), nproc=2)
    plain, sp = losses(runs["plain"]), losses(runs["sp"])
    assert sorted(plain) == sorted(sp) == [1, 2, 3, 4, 5, 6]
    assert [sp[s] for s in range(1, 7)] == pytest.approx([plain[s] for s in range(1, 7)], abs=1e-5)
    assert len(set(sp.values())) > 1  # it learned: not one loss repeated
    evals = {n: [r["eval/accuracy"] for r in read_jsonl(os.path.join(runs[n], "metrics.jsonl")) if "eval/accuracy" in r]
             for n in runs}
    assert evals["plain"] and evals["plain"] == pytest.approx(evals["sp"], abs=1e-6)


def test_distributed_optimizer_resumes_at_another_dp_and_refuses_another_tp(data, tmp_path):
    """fp32 with the distributed optimizer, whose state each rank saves as its own shard (checkpoint/optim_state.py
    LAYOUT): stopped at step 3 on 2 ranks (DP=2), it resumes on one (DP=1) along the same curve; at
    TP=2 the resume stops at once with one line saying which settings resume it."""
    import shutil

    distopt = {"parallel.use_distributed_optimizer": "true"}
    straight, split, one, tp2 = (tmp_path / n for n in ("straight", "split", "one", "tp2"))
    run_cli("sft", overrides(data, straight, **distopt), nproc=2)
    run_cli("sft", overrides(data, split, **distopt, **{"train.exit_at_step": 3}), nproc=2)
    shutil.copytree(split, tp2)
    proc = run_cli("sft", overrides(data, tp2, **distopt, **{"parallel.tp": 2}), nproc=2, check=False)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, lines
    assert "resumes only at the parallel.tp and parallel.pp it was saved with (any DP; this run has parallel.tp=2)" \
        in lines[0] and "resume with parallel.tp=1, or start a new run" in lines[0], lines
    shutil.copytree(split, one)
    run_cli("sft", overrides(data, one, **distopt), nproc=1)
    a, c = losses(straight), losses(one)
    assert sorted(a) == sorted(c) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):  # another DP: the same curve up to fp32 summation order
        assert c[s] == pytest.approx(a[s], rel=1e-5), s


def test_kill_9_during_save_keeps_previous_checkpoint(data, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_cli("sft", overrides(data, straight))
    proc = run_cli("sft", overrides(data, crashed), env={"MEGATRON_RLHF_CRASH_AT": "after_shards:4"}, check=False)
    assert proc.returncode != 0
    ckpts = crashed / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert (ckpts / ".tmp-step_00000004").is_dir()  # the half-written save never became a checkpoint
    assert not (ckpts / "step_00000004").exists()
    proc = run_cli("sft", overrides(data, crashed))
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout
    a, b = losses(straight), losses(crashed)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert not (ckpts / ".tmp-step_00000004").exists()
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000006"]  # keep_last=2


def test_a_stop_during_a_periodic_save_ends_at_that_step(data, tmp_path):
    """SIGTERM to rank 1 while step 2's interval save writes: both ranks exit 0 at step 2 (the checkpoint just
    written is the stop's; no further step and save of a preempted job's grace time), and a rerun goes on."""
    run = tmp_path / "run"
    proc = run_cli("sft", overrides(data, run), nproc=2, env={"MEGATRON_RLHF_STOP_AT": "after_shards:2:1"})
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert sorted(losses(run)) == [1, 2]
    assert proc.stdout.count("stop requested: saved checkpoint at step 2, exiting") == 1, proc.stdout[-3000:]
    proc = run_cli("sft", overrides(data, run), nproc=2)
    assert "step_00000002 at step 2" in proc.stdout and sorted(losses(run)) == [1, 2, 3, 4, 5, 6]


def test_sigterm_saves_and_exits_zero_then_resumes(data, tmp_path):
    run = tmp_path / "preempted"
    args = overrides(data, run, **{"train.train_steps": 100000, "checkpoint.save_interval": 0})
    # A world of one without torchrun, as `srun` would start one task; SIGTERM goes to the trainer itself.
    ready = lambda: (run / "metrics.jsonl").exists() and len(losses(run)) >= 3  # noqa: E731
    rc, out = sigterm_when([sys.executable, str(CLI), "sft", *args], tmp_path / "preempted.log", ready)
    assert rc == 0, out[-3000:]
    stopped_at = max(losses(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert "stop requested" in out

    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    resumed = run_reaped([sys.executable, str(CLI), "sft", *args, f"train.train_steps={stopped_at + 2}"],
                         env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped_at}" in resumed.stdout
    assert max(losses(run)) == stopped_at + 2


def test_pipeline_from_hf_checkpoint_with_rm_calibration(data, tmp_path):
    """HF Llama -> convert -> SFT (tp=2) -> RM initialised from the SFT policy -> calibration stats."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, mcore = tmp_path / "hf", tmp_path / "mcore"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=17, max_position_embeddings=32)).save_pretrained(hf_dir)
    env = child_env()
    conv = run_reaped([sys.executable, str(CLI), "convert", "hf-to-megatron", "--hf-dir", str(hf_dir),
                       "--out", str(mcore)], env=env, timeout=600)
    assert conv.returncode == 0, conv.stderr[-3000:]

    sft_run, rm_run = tmp_path / "sft", tmp_path / "rm"
    arch_free = lambda args: [a for a in args if not a.startswith("model.")]  # architecture comes from model.load
    run_cli("sft", arch_free(overrides(data, sft_run, **{"parallel.tp": 2})) + [f"model.load={mcore}"], nproc=2)
    rm_args = arch_free(overrides(data, rm_run, "rm", **{"train.train_steps": 4}))
    rm_args = [a for a in rm_args if not a.startswith("calibration.")] + [
        f"model.load={sft_run / 'checkpoints'}", "calibration.num_prompts=8", "calibration.max_new_tokens=6",
        "calibration.batch_size=4", f"calibration.prompts_path={data / 'sft.jsonl'}"]
    proc = run_cli("rm", rm_args, nproc=2)
    assert "reward calibration: mean" in proc.stdout
    stats = json.loads((rm_run / "reward_calibration.json").read_text())
    assert stats["num_samples"] == 8 and stats["std"] > 0 and abs(stats["mean"]) < 1e3

    from megatron.core import dist_checkpointing

    latest = rm_run / "checkpoints" / (rm_run / "checkpoints" / "latest").read_text().strip()
    common = dist_checkpointing.load_common_state_dict(str(latest))
    assert common["extra"]["reward_calibration"] == pytest.approx(stats)


def test_resume_at_epoch_boundary(data, tmp_path):
    """64 rows / batch 8 = 8 steps per epoch: stop exactly at the epoch end, resume into epoch 2 (a rerun of a
    finished run: test_run_messages.py)."""
    rows = (data / "sft.jsonl").read_text().splitlines(keepends=True)[:64]
    (tmp_path / "sft64.jsonl").write_text("".join(rows))
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = {"train.train_steps": 10, "checkpoint.save_interval": 0, "data.train_path": tmp_path / "sft64.jsonl"}
    run_cli("sft", overrides(data, straight, **common))
    run_cli("sft", overrides(data, split, **common, **{"train.exit_at_step": 8}))
    assert max(losses(split)) == 8
    proc = run_cli("sft", overrides(data, split, **common))
    assert "at step 8" in proc.stdout, proc.stdout[-2000:]
    a, b = losses(straight), losses(split)
    assert [a[s] for s in range(1, 11)] == [b[s] for s in range(1, 11)]


def test_a_save_with_invalid_sharding_fails_on_every_rank_at_once(tmp_path):
    """Megatron checks a save's sharding on rank 0 alone; with its verdict shared (checkpoint/sharding.py) a
    defect such as two optimizers writing the same keys is one CheckpointError on every rank, not a rank 1
    waiting in the write until the job's timeout."""
    out = tmp_path / "result.json"
    torchrun("invalid_sharding_save.py", str(tmp_path / "ckpt"), str(out), nproc=2, timeout=300)
    r = read_json(out)
    errors = [rank["error"] for rank in r["ranks"]]
    assert all(e is not None and "invalid sharding" in e and "Duplicate ShardedObject keys" in e for e in errors), r
    assert errors[0] == errors[1] and "step_00000001 is intact" in errors[0], r
    assert max(rank["took"] for rank in r["ranks"]) < 30, r  # at once, not at the watchdog's 60 s
    assert r["latest"] == "step_00000001" and r["entries"] == ["latest", "step_00000001"], r
