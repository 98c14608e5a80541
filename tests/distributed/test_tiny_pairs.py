"""`tiny-pairs` on 2 gloo ranks (dp=2): preference pairs sampled from a (briefly trained) SFT policy.

Checks the rows (count, fields, prompt order, prompts reused past the end of the file), that the same
seed gives the same file, and that labels follow the true score when the two scores are far apart; and
the `--gold-scorer` path (text responses, chat prompts rendered by a chat template) against it.
"""

import json

import pytest

from megatron_rlhf.tasks import sort_digits
from tests.distributed.launch import CLI, torchrun
from tests.distributed.stages import task_dir

NUM_PROMPTS, NUM_PAIRS, MAX_NEW = 32, 40, 8  # 40 > 32: pairs 32..39 reuse prompts 0..7


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """Tokenizer, prompts and a tiny SFT checkpoint (a few steps: enough to emit EOS sometimes)."""
    d, write, rng = task_dir(tmp_path_factory, "tiny_pairs")
    write("sft.jsonl", sort_digits.demonstrations(256, rng))
    write("prompts.jsonl", sort_digits.prompts(NUM_PROMPTS, rng))
    sft = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.ffn_hidden_size": 64,
        "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.vocab_size": 17,
        "model.max_position_embeddings": 32, "tokenizer.path": d / "tokenizer",
        "data.train_path": d / "sft.jsonl", "data.max_seq_len": 24, "train.lr": 3e-3,
        "train.lr_schedule": "constant", "train.global_batch_size": 32, "train.micro_batch_size": 16,
        "train.train_steps": 4, "train.seed": 3, "logging.run_dir": d / "sft", "logging.progress_bar": "false",
        "checkpoint.save_interval": 0,
    }
    torchrun(CLI, "sft", *[f"{k}={v}" for k, v in sft.items()], nproc=1)
    return d


def _pairs(d, out, seed=5, prompts="prompts.jsonl", tokenizer="tokenizer", extra=()):
    return torchrun(
        CLI, "tiny-pairs", "--policy", d / "sft" / "checkpoints", "--prompts", d / prompts,
        "--tokenizer", d / tokenizer, "--num-pairs", NUM_PAIRS, "--out", out, "--seed", seed,
        "--batch-size", 8, "--max-new-tokens", MAX_NEW, *extra, nproc=2,
    )


def gold_scores(prompts, responses):
    """A gold scorer in the `ppo.gold_scorer` contract over text: the tiny true score of the decoded response
    (the EOS token's text, appended when the response finished, made a word of its own)."""
    return sort_digits.gold_scores(prompts, [r.replace("<eos>", " <eos>") for r in responses])


def test_gold_scorer_with_chat_prompts_writes_the_tiny_file(policy, tmp_path):
    """Chat rows through a chat template that renders the same ids as the plain prompts, scored by a text
    scorer that gives the tiny true score: the same samples, scores and labels, so the same file, with the
    prompts written as text the preference loader tokenizes back to the sampled ids (the BOS it adds itself
    left out)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy / "tokenizer")
    tok.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(policy / "chat_tokenizer")
    rows = _jsonl(policy / "prompts.jsonl")
    (policy / "chat_prompts.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}]}) + "\n" for r in rows))
    plain, chat = tmp_path / "plain.jsonl", tmp_path / "chat.jsonl"
    _pairs(policy, plain)
    proc = _pairs(policy, chat, prompts="chat_prompts.jsonl", tokenizer="chat_tokenizer",
                  extra=("--gold-scorer", f"{__name__}:gold_scores"))
    assert "tiny-pairs: wrote" in proc.stdout, proc.stdout[-2000:]
    assert chat.read_bytes() == plain.read_bytes()


def test_tiny_pairs_rows_order_determinism_and_labels(policy, tmp_path):
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    proc = _pairs(policy, first)
    assert "tiny-pairs: wrote" in proc.stdout, proc.stdout[-2000:]
    rows = _jsonl(first)
    prompts = [r["prompt"] for r in _jsonl(policy / "prompts.jsonl")]

    # One row per pair, in prompt order, prompts reused cyclically past the end of the file.
    assert len(rows) == NUM_PAIRS, proc.stdout[-2000:]
    for i, r in enumerate(rows):
        assert set(r) == {"prompt", "chosen", "rejected"}, r
        assert r["prompt"] == prompts[i % NUM_PROMPTS], (i, r)
        assert r["chosen"] != r["rejected"] and r["chosen"].strip() and r["rejected"].strip(), r
        assert "<eos>" not in r["chosen"].split() + r["rejected"].split(), r

    # Same seed, same layout: the same file, byte for byte; another seed: other samples.
    _pairs(policy, again)
    assert again.read_bytes() == first.read_bytes()
    other = tmp_path / "c.jsonl"
    _pairs(policy, other, seed=6)
    assert other.read_bytes() != first.read_bytes()

    # Labels follow the true score when it clearly differs: P(better chosen) = sigmoid(10 * gap) >= 0.99
    # for gaps >= 0.5. A response without EOS fills all MAX_NEW tokens (a finished one has fewer words).
    def score(prompt, text):
        return sort_digits.true_score(prompt, text, finished=len(text.split()) < MAX_NEW)

    gaps = [(score(r["prompt"], r["chosen"]), score(r["prompt"], r["rejected"])) for r in rows]
    assert all(c != w for c, w in gaps), gaps  # ties (coin-flip labels) are resampled by default
    clear = [(c, w) for c, w in gaps if abs(c - w) >= 0.5]
    assert len(clear) >= 5, gaps  # the check has teeth: enough pairs far apart
    right = sum(c > w for c, w in clear)
    assert right >= 0.9 * len(clear), (right, clear)
    assert any(s == -1.0 for pair in gaps for s in pair), gaps  # unfinished responses are kept
