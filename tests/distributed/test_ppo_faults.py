"""Stage 3 under faults and bad input, through `megatron-rlhf launch` on the tiny pipeline's checkpoints
(issue 22): a gold scorer that blocks on one rank ends the job naming that rank (item 5), one that raises
on one rank only is one error line on a job that ends, resuming with ppo.iterations below the checkpoint
is refused and keeps config.yaml (item 11), and a held-out set smaller than the data-parallel ranks is
refused at start."""

import json
import sys

from tests.distributed.launch import CLI, ROOT, child_env, run_reaped
from tests.distributed.test_ppo import ppo_args

SMALL = {"ppo.iterations": 2, "ppo.rollout_batch_size": 32, "ppo.minibatch_size": 32, "ppo.epochs": 1,
         "ppo.eval_prompts": 16, "ppo.sample_interval": 0, "ppo.eval_interval": 0, "ppo.export_hf": "false"}

SCORER = '''
import os, threading

def blocks_on_rank_1(prompts, responses):
    if os.environ["RANK"] == "1":
        threading.Event().wait()  # a scorer waiting on a lock nobody releases
    return [0.0] * len(prompts)

def raises_on_rank_1(prompts, responses):
    if os.environ["RANK"] == "1":
        raise RuntimeError("scoring service unreachable")
    return [0.0] * len(prompts)
'''


def _launch(base, run, tmp_path, timeout=600, **extra):
    (tmp_path / "faulty_scorer.py").write_text(SCORER)
    env = child_env({"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    cmd = [sys.executable, str(CLI), "launch", "--nproc-per-node", "2", *ppo_args(base, run, **{**SMALL, **extra})]
    proc = run_reaped(cmd, env=env, timeout=timeout)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return proc, errors


def test_a_scorer_blocked_on_one_rank_ends_the_job_naming_the_rank(base, tmp_path):
    proc, errors = _launch(base, tmp_path / "run", tmp_path, **{
        "ppo.gold_scorer": "faulty_scorer:blocks_on_rank_1", "parallel.timeout_s": 15})
    assert proc.returncode == 124, (proc.returncode, proc.stderr[-3000:])
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 made no progress for "), proc.stderr[-3000:]
    assert "faulty_scorer.py" in errors[0] and "(blocks_on_rank_1)" in errors[0], errors
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_scorer_that_raises_on_one_rank_is_one_line(base, tmp_path):
    proc, errors = _launch(base, tmp_path / "run", tmp_path, **{"ppo.gold_scorer": "faulty_scorer:raises_on_rank_1"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert errors == ["error: ppo.gold_scorer (faulty_scorer:raises_on_rank_1) raised RuntimeError: scoring service "
                      "unreachable on prompt " + errors[0].split(" on prompt ", 1)[1]] if errors else False, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_resume_with_fewer_iterations_than_the_checkpoint_is_refused(base, tmp_path):
    run = tmp_path / "run"
    first, _ = _launch(base, run, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    config = (run / "config.yaml").read_text()
    again, errors = _launch(base, run, tmp_path, **{"ppo.iterations": 1})
    assert again.returncode == 2, (again.returncode, again.stderr[-3000:])
    assert len(errors) == 1 and errors[0].startswith("error: ppo.iterations=1 is below the iteration of the checkpoint "
                                                     "this run resumes from"), again.stderr[-3000:]
    assert "iteration 2): set ppo.iterations >= 2" in errors[0], errors
    assert (run / "config.yaml").read_text() == config  # the record of the run that made the checkpoints
    assert json.loads((run / "summary.json").read_text())["iterations"] == 2


def test_fewer_held_out_prompts_than_ranks_is_refused_at_start(base, tmp_path):
    (tmp_path / "one.jsonl").write_text((base / "prompts_eval.jsonl").read_text().splitlines()[0] + "\n")
    proc, errors = _launch(base, tmp_path / "run", tmp_path, **{"data.eval_path": tmp_path / "one.jsonl"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert errors == ["error: held-out evaluation needs a prompt per data-parallel rank: 1 in data.eval_path, "
                      "ppo.eval_prompts=16, 2 ranks; give more held-out prompts, raise ppo.eval_prompts, or unset "
                      "data.eval_path"], proc.stderr[-3000:]


def test_fewer_prompts_than_a_rollout_batch_names_the_ppo_key(base, tmp_path):
    (tmp_path / "few.jsonl").write_text("".join((base / "prompts.jsonl").read_text().splitlines(True)[:8]))
    proc, errors = _launch(base, tmp_path / "run", tmp_path, **{"data.train_path": tmp_path / "few.jsonl"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert errors == ["error: the dataset has 8 examples, fewer than one global batch (ppo.rollout_batch_size=32): "
                      "lower the batch size or add data"], proc.stderr[-3000:]
