"""The sort-digits task: tokenizer, true score, demonstrator, Bradley-Terry labels, files."""

import json
import math
import random

import pytest

from megatron_rlhf.tasks import sort_digits as T


def test_tokenizer_is_17_words_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    tok = T.build_tokenizer()
    assert len(tok) == 17 == len(T.VOCAB)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (T.PAD_ID, T.BOS_ID, T.EOS_ID)
    ids = tok("sort 3 1 2 =")["input_ids"]
    assert ids == [T.BOS_ID] + [T.VOCAB.index(w) for w in "sort 3 1 2 =".split()]
    loaded = AutoTokenizer.from_pretrained(T.save_tokenizer(str(tmp_path / "tok")), local_files_only=True)
    assert loaded("sort 3 1 2 =")["input_ids"] == ids and loaded.padding_side == "left"
    with pytest.raises(Exception):  # no unknown token: a foreign word is an error
        tok("sort banana =")


def test_true_score():
    p = "sort 3 1 2 ="
    assert T.true_score(p, "1 2 3 <eos>") == 1.0
    assert T.true_score(p, "1 2 <eos> 9 9") == pytest.approx(1 - 1 / 3)  # tokens after EOS are ignored
    assert T.true_score(p, "1 2 3") == -1.0  # never emitted EOS
    assert T.true_score(p, "1 2 3", finished=True) == 1.0
    assert T.true_score(p, "9 9 9 9 9 9 9 <eos>") == -1.0  # floored
    assert T.true_score("<bos> sort 5 5 0 1 =", "0 1 5 <eos>") == pytest.approx(0.75)
    prompt_ids = [T.BOS_ID] + [T.VOCAB.index(w) for w in p.split()]
    one, three = T.VOCAB.index("1"), T.VOCAB.index("3")
    assert T.true_score_ids(prompt_ids, [one, three, T.EOS_ID, T.PAD_ID]) == pytest.approx(1 - 1 / 3)
    assert T.true_score_ids([T.PAD_ID] + prompt_ids, [one, three]) == -1.0  # left padding ignored; no EOS
    assert T.levenshtein([1, 2, 3], [1, 3]) == 1 and T.levenshtein([], [1, 2]) == 2 and T.levenshtein("kitten", "sitting") == 3


def test_demonstrator_is_imperfect_as_specified():
    rng = random.Random(0)
    n, drop_last, exact, scores = 4000, 0, 0, []
    for _ in range(n):
        digits = T.random_digits(rng)
        demo = T.demonstrate(digits, rng)
        drop_last += demo == sorted(digits)[:-1]
        exact += demo == sorted(digits)
        scores.append(T.score_tokens("sort", digits, [str(d) for d in demo], True))
    assert abs(drop_last / n - 0.6) < 0.04  # plus a few edits that happen to delete the last digit
    assert exact / n < 0.1
    assert 0.7 < sum(scores) / n < 0.8  # the reference measured 0.749 for the SFT policy


def test_label_pair_follows_bradley_terry():
    rng = random.Random(1)
    prompt = "sort 5 1 4 2 3 ="  # n = 5: one edit costs 0.2 of score
    better, worse = "1 2 3 4 5", "1 2 3 4"
    trials = 4000
    wins = sum(T.label_pair(prompt, better, worse, rng)[0] == better for _ in range(trials))
    expected = 1 / (1 + math.exp(-10 * 0.2))
    assert abs(wins / trials - expected) < 0.03
    # an unfinished response scores -1
    assert T.label_pair(prompt, better, worse, random.Random(0), finished_a=False, sharpness=1e3) == (worse, better)


def test_synthetic_pairs_prefer_the_better_response_mostly():
    rows = T.synthetic_pairs(2000, random.Random(2))
    diffs = [T.true_score(r["prompt"], r["chosen"], True) - T.true_score(r["prompt"], r["rejected"], True) for r in rows]
    decided = [d for d in diffs if d != 0]
    assert all(r["chosen"] != r["rejected"] and r["chosen"] and r["rejected"] for r in rows)
    assert sum(d > 0 for d in decided) / len(decided) > 0.8


def test_write_tiny_task_is_deterministic(tmp_path):
    kw = dict(num_sft=30, num_sft_eval=5, num_pairs=20, num_pairs_eval=5, num_prompts=10, num_prompts_eval=5)
    a = T.write_tiny_task(str(tmp_path / "a"), seed=0, **kw)
    b = T.write_tiny_task(str(tmp_path / "b"), seed=0, **kw)
    c = T.write_tiny_task(str(tmp_path / "c"), seed=1, **kw)
    read = lambda p: open(p).read()  # noqa: E731
    for name in ("sft", "pairs", "prompts", "sft_eval"):
        assert read(a[name]) == read(b[name])
    assert read(a["sft"]) != read(c["sft"])
    rows = [json.loads(line) for line in open(a["sft"])]
    assert len(rows) == 30 and all("<eos>" not in r["response"] for r in rows)
    assert all(T.parse_prompt(r["prompt"])[0] == "sort" for r in rows)
