"""Issue 45: PPO with a reward model of another size, architecture and tokenizer (SmolLM2's BPE beside the tiny task's
word-level policy), and a critic of another size, on 2 ranks.

The reward model (3 layers, hidden 96, 6 heads / 3 key/value heads: no TP or PP of 2 divides it) scores at its own
inference layout (ppo.inference_tp=1, or ppo.reward_inference_tp=1 beside a reference at TP=2); the policy trains at
TP=1 x DP=2, TP=2 and PP=2 (and on 1 rank), the critic (2 layers, hidden 48) beside it. Every held-out sample's
in-PPO reward score equals the reward model scoring the same text directly, rendered by the preference loader (what
stage 2 trains on), within fp32 batching noise (one row at a time against micro-batches: up to ~6e-6 on this CPU),
and bit for bit where the direct scorer batches the rows as the run's inference layout does (policy at TP=2, PP=2
and on 1 rank); a resumed run is bit-identical.
"""

import json

import pytest

from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import CLI, torchrun
from tests.distributed.test_ppo import _args, learning_metrics, rows

BATCHING_NOISE = 1e-5  # fp32 GEMMs of other shapes (a row alone vs a padded micro-batch) on CPU


@pytest.fixture(scope="module")
def own(tmp_path_factory, smollm2):
    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR
    from megatron_rlhf.tasks import sort_digits
    import random

    d = tmp_path_factory.mktemp("own_models")
    reward_tok = str(smollm2["megatron"] / TOKENIZER_DIR)
    torchrun("own_models.py", "make", d, reward_tok, nproc=1)
    rng = random.Random(3)
    for name, n in (("prompts.jsonl", 64), ("prompts_eval.jsonl", 16)):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in sort_digits.prompts(n, rng)))
    return d, reward_tok


def _ppo(own, run_dir, nproc=2, **extra):
    d, reward_tok = own
    settings = {
        "model.load": d / "policy", "tokenizer.path": d / "tokenizer", "data.train_path": d / "prompts.jsonl",
        "data.eval_path": d / "prompts_eval.jsonl", "data.max_seq_len": 24, "data.max_prompt_len": 12,
        "train.lr": 1e-4, "train.lr_schedule": "constant", "train.micro_batch_size": 4, "train.seed": 1,
        "ppo.reward_load": d / "reward", "ppo.reward_tokenizer": reward_tok, "ppo.inference_tp": 1,
        "ppo.value_load": d / "value", "ppo.normalize_reward": "false", "ppo.iterations": 2,
        "ppo.rollout_batch_size": 16, "ppo.minibatch_size": 8, "ppo.epochs": 1, "ppo.max_new_tokens": 8,
        "ppo.eval_interval": 1, "ppo.eval_prompts": 16, "checkpoint.save_interval": 1, "logging.run_dir": run_dir,
        "logging.progress_bar": "false",
    }
    settings.update(extra)
    return torchrun(CLI, "ppo", *_args(settings), nproc=nproc, timeout=600)


def _scores_equal_direct(own, run_dir, tmp_path, batch=None, packed=False):
    """The in-PPO scores of run_dir's samples against the reward model scoring their text directly: within
    BATCHING_NOISE one row at a time, or bit for bit batched as the run batched them (`batch` rows, `packed`)."""
    d, reward_tok = own
    samples = run_dir / "samples.jsonl"
    out = tmp_path / f"{run_dir.name}_direct_{batch}.json"
    how = [batch, *(["packed"] if packed else [])] if batch else []
    torchrun("own_models.py", "score", d, reward_tok, samples, out, *how, nproc=1)
    direct = json.loads(out.read_text())
    in_ppo = [json.loads(line)["rm_score"] for line in samples.read_text().splitlines()]
    assert len(in_ppo) == len(direct["scores"]) >= 16
    worst = max(abs(a - b) for a, b in zip(in_ppo, direct["scores"]))
    assert worst <= (0.0 if batch else BATCHING_NOISE), (worst, in_ppo, direct["scores"])
    assert len(set(in_ppo)) > len(in_ppo) // 2  # the rows were scored, not a constant
    assert not packed or direct["packed_microbatches"] > 0  # the packed path is among those compared
    return direct["ended"]


@pytest.mark.parametrize("layout, exact", [
    ({"parallel.tp": 1}, False),  # the reward model scores in the training layout (TP=1 x DP=2), as one step
    # The reward model at TP=1 x DP=2 beside a policy at TP=2 or PP=2 (DP=1): each of its ranks scores 4 of an
    # eval's 8 rows (all of them in samples.jsonl) as one micro-batch of its own width, packed where that pays.
    ({"parallel.tp": 2, "ppo.inference_tp": 2, "ppo.reward_inference_tp": 1, "ppo.eval_prompts": 8}, True),
    ({"parallel.pp": 2, "ppo.eval_prompts": 8}, True)], ids=["tp1_dp2", "tp2", "pp2"])
def test_a_reward_model_of_its_own_size_and_tokenizer_scores_as_it_would_directly(own, tmp_path, layout, exact):
    run = tmp_path / "ppo"
    proc = _ppo(own, run, **layout)
    assert "ppo: trained iterations 1-2 of 2" in proc.stdout, proc.stdout[-3000:]
    ended = _scores_equal_direct(own, run, tmp_path)
    assert any(ended) and not all(ended)  # finished (EOS rendered as the reward model's) and cut responses
    if exact:  # the direct scorer batching and packing the rows as the run did: bit for bit
        _scores_equal_direct(own, run, tmp_path, batch=4, packed=True)
    by_step = rows(run)
    for step in (1, 2):
        assert by_step[step]["time/retokenize"] > 0 and by_step[step]["ppo/reward_truncated_fraction"] == 0.0
        assert by_step[step]["ppo/value_loss"] > 0  # the critic of its own size trained
    value_arch = json.loads((run / "checkpoints" / "value_model_config.json").read_text())
    assert (value_arch["num_layers"], value_arch["hidden_size"]) == (2, 48)  # a later ppo.value_load builds it


def test_such_a_run_resumes_bit_identically(own, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _ppo(own, whole, **{"parallel.pp": 2})
    _ppo(own, parts, **{"parallel.pp": 2, "train.exit_at_step": 1})
    assert max(rows(parts)) == 1
    proc = _ppo(own, parts, **{"parallel.pp": 2})
    assert "resumed from" in proc.stdout
    a, b = rows(whole), rows(parts)
    assert learning_metrics(a[2]) == learning_metrics(b[2])
    assert [r["rm_score"] for r in read_jsonl(str(whole / "samples.jsonl"))][-8:] == \
        [r["rm_score"] for r in read_jsonl(str(parts / "samples.jsonl"))][-8:]


def test_the_in_ppo_score_equals_the_direct_score_bit_for_bit(own, tmp_path):
    """One rank, the reward model in its inference layout: each evaluation's 8 rows are run 4 (train.micro_batch_size)
    at a time, each micro-batch right-padded to its widest and packed where that pays (packed and padded are other
    GEMM shapes: within 1e-6 of each other, test_packing); the direct scorer batches and packs the rendered text
    alike."""
    run = tmp_path / "one_rank"
    _ppo(own, run, nproc=1, **{"ppo.iterations": 1, "ppo.eval_prompts": 8, "ppo.rollout_batch_size": 8,
                               "checkpoint.save_interval": 0})
    ended = _scores_equal_direct(own, run, tmp_path, batch=4, packed=True)
    assert any(ended) and not all(ended)
