"""The chat digit-sorting task of examples/smollm2: prompt parsing, answer parsing, gold score, files."""

import json
import random

import pytest

from megatron_rlhf import cli
from megatron_rlhf.tasks import chat_sort, sort_digits

EOS = chat_sort.EOS_TEXT
# What the PPO stage hands a gold scorer: the rendered prompt without special tokens (SmolLM2's template).
PROMPT = ("system\nAnswer with the sorted digits only, separated by spaces.\nuser\n"
          "Sort these digits in ascending order: 7 3 9 1.\nassistant\n")


def test_prompt_digits_read_the_last_question_with_or_without_markup():
    assert chat_sort.prompt_digits(PROMPT) == [7, 3, 9, 1]
    marked = "<|im_start|>user\n" + chat_sort.question([0, 0, 5]) + "<|im_end|>\n<|im_start|>assistant\n"
    assert chat_sort.prompt_digits(marked) == [0, 0, 5]
    two = chat_sort.question([1, 2, 3]) + " then " + chat_sort.question([9, 8, 7])
    assert chat_sort.prompt_digits(two) == [9, 8, 7]
    with pytest.raises(ValueError, match="not a chat-sort prompt"):
        chat_sort.prompt_digits("What is the capital of France?")


@pytest.mark.parametrize("answer, digits", [
    ("1 3 7 9", [1, 3, 7, 9]), ("1, 3, 7, 9", [1, 3, 7, 9]), ("1379", [1, 3, 7, 9]), ("[1, 3, 7, 9].", [1, 3, 7, 9]),
    ("There are 4 digits: 1 3 7 9", [4, 1, 3, 7, 9]), ("none", []),
])
def test_answer_digits_are_every_digit_character_before_eos(answer, digits):
    assert chat_sort.answer_digits(answer + EOS + " 5 5") == (digits, True)
    assert chat_sort.answer_digits(answer) == (digits, False)


def test_gold_score_is_the_tiny_true_score_of_the_parsed_digits():
    responses = ["1 3 7 9" + EOS, "1, 3, 7, 9" + EOS, "1 3 7" + EOS, "1 3 7 9", "9 7 3 1 0 0 0 0 0 0" + EOS, EOS,
                 "There are 4 digits: 1 3 7 9" + EOS]
    got = chat_sort.gold_scores([PROMPT] * len(responses), responses)
    assert got == [1.0, 1.0, 0.75, -1.0, -1.0, 0.0, 0.75]
    for r, g in zip(responses, got):  # the same number as the tiny task's own true score of those digits
        digits, finished = chat_sort.answer_digits(r)
        assert g == sort_digits.score_tokens("sort", [7, 3, 9, 1], [str(d) for d in digits], finished)
    assert chat_sort.gold_scores([PROMPT], ["1 3 7 9</s>"], eos_text="</s>") == [1.0]


def test_prepare_chat_sort_writes_chat_rows_from_the_tiny_task(tmp_path):
    out = tmp_path / "data"
    assert cli.main(["prepare-chat-sort", str(out), "--num-sft", "20", "--num-prompts", "30",
                     "--num-prompts-eval", "10"]) == 0
    rows = {n: [json.loads(line) for line in (out / f"{n}.jsonl").read_text().splitlines()]
            for n in ("sft", "sft_eval", "prompts", "prompts_eval")}
    assert [len(rows[n]) for n in ("sft", "prompts", "prompts_eval")] == [20, 30, 10]
    for r in rows["prompts"]:
        system, user = r["messages"]
        assert system == {"role": "system", "content": chat_sort.INSTRUCTION} and user["role"] == "user"
        digits = chat_sort.prompt_digits(user["content"])
        assert sort_digits.MIN_DIGITS <= len(digits) <= sort_digits.MAX_DIGITS
    for r in rows["sft"]:  # the imperfect demonstrator's answers, digits separated by spaces
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
        answer = r["messages"][2]["content"]
        assert answer == " ".join(answer.split()) and all(w.isdigit() and len(w) == 1 for w in answer.split())
    score = [chat_sort.true_score(r["messages"][1]["content"], r["messages"][2]["content"] + EOS) for r in rows["sft"]]
    assert any(s < 1 for s in score) and all(s >= -1 for s in score)
    # Deterministic per seed; the training and held-out prompts are different streams.
    again = tmp_path / "again"
    chat_sort.write_task(str(again), num_prompts=30, num_prompts_eval=10, num_sft=20)
    assert (again / "prompts.jsonl").read_bytes() == (out / "prompts.jsonl").read_bytes()
    assert rows["prompts"][:10] != rows["prompts_eval"]
    expected = chat_sort.prompt_rows(30, random.Random("0/chat_sort/prompts"))
    assert rows["prompts"] == expected


def test_prepare_chat_sort_rejects_bad_counts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        chat_sort.main([str(tmp_path), "--num-prompts", "0"])
    assert "--num-prompts must be >= 1" in capsys.readouterr().err


def test_pairs_gold_scorer_errors_are_one_line_naming_the_option():
    from megatron_rlhf.config.fields import ConfigError
    from megatron_rlhf.trainer import pairs

    tok = sort_digits.build_tokenizer()
    with pytest.raises(ConfigError, match="--gold-scorer 'no_such_module:f' cannot be imported"):
        pairs.Scoring("no_such_module:f", tok)
    broken = pairs.Scoring("megatron_rlhf.tasks.chat_sort:gold_scores", tok)  # tiny prompts are no chat-sort prompts
    with pytest.raises(ConfigError, match="failed on prompt 'sort 1 2 =' .*not a chat-sort prompt"):
        broken.score("sort 1 2 =", ("1 2", True))
    with pytest.raises(SystemExit):
        pairs._parse(["--policy", "p", "--prompts", "q", "--tokenizer", "t", "--num-pairs", "1", "--out", "o",
                      "--gold-scorer", "no_colon"])


def test_pairs_text_scoring_appends_the_eos_text_when_finished():
    from megatron_rlhf.trainer import pairs

    tok = sort_digits.build_tokenizer()
    seen = []
    scoring = pairs.Scoring("megatron_rlhf.tasks.chat_sort:gold_scores", tok)
    scoring.fn = lambda p, r: seen.append((p, r)) or [0.5]
    ids = tok("sort 2 1 =")["input_ids"]  # <bos> sort 2 1 =
    prompt = scoring.prompt(ids)
    assert prompt == "sort 2 1 =" and list(tok(prompt)["input_ids"]) == ids  # the BOS the tokenizer adds goes
    answer = scoring.response(tok("1 2", add_special_tokens=False)["input_ids"] + [sort_digits.EOS_ID])
    assert answer == ("1 2", True)
    assert scoring.score(prompt, answer) == 0.5 and scoring.score(prompt, ("1 2", False)) == 0.5
    assert seen == [(["sort 2 1 ="], ["1 2<eos>"]), (["sort 2 1 ="], ["1 2"])]
