"""Datasets: row validation and counting, truncation, chat masking, formats, collation (the batch sampler:
test_batch_sampler.py)."""

import json

import pytest
import torch

from megatron_rlhf.data import dataset as D
from megatron_rlhf.data.collate import collate_preference, collate_prompts, collate_sft, microbatches
from megatron_rlhf.config.schema import DataConfig
from megatron_rlhf.tasks import sort_digits


@pytest.fixture(scope="module")
def tok():
    return sort_digits.build_tokenizer()


def write_lines(path, rows):
    """rows: dicts (dumped as JSON) or raw strings (written as is, e.g. broken JSON)."""
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def cfg(**kw):
    kw.setdefault("max_bad_fraction", 0.0)
    kw.setdefault("seed", 0)
    return DataConfig(**kw)


def ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


# ---------------------------------------------------------------------------------------------
# SFT rows
# ---------------------------------------------------------------------------------------------


def test_sft_prompt_response_tokens_and_mask(tmp_path, tok):
    path = write_lines(tmp_path / "a.jsonl", [{"prompt": "sort 3 1 2 =", "response": "1 2 3"}])
    ds, report = D.load_examples("sft", cfg(), tok, path, log=None)
    row = ds[0]
    prompt = ids(tok, "sort 3 1 2 =", special=True)
    response = ids(tok, "1 2 3") + [tok.eos_token_id]
    assert prompt[0] == tok.bos_token_id
    assert row["input_ids"] == prompt + response
    assert row["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    assert (report.total, report.kept, report.num_bad) == (1, 1, 0)


def test_malformed_rows_counted_and_skipped(tmp_path, tok):
    good = [{"prompt": f"sort {d} =", "response": str(d)} for d in range(10)]
    bad = [
        {"prompt": "sort 1 ="},  # missing response
        {"prompt": "sort 1 =", "response": None},  # null counts as missing
        {"prompt": "   ", "response": "1"},  # empty prompt
        {"prompt": "sort 1 =", "response": 5},  # wrong type
        {"prompt": ["sort"], "response": "1"},  # wrong type
        '{"prompt": "sort 1 =", "response": ',  # broken JSON
        "[1, 2]",  # not an object
        {"prompt": "sort 1 =", "response": "banana"},  # word the tokenizer does not know
    ]
    path = write_lines(tmp_path / "mixed.jsonl", good[:5] + bad + good[5:] + [""])  # blank lines are ignored
    logged = []
    ds, report = D.load_examples("sft", cfg(max_bad_fraction=0.5), tok, path, log=logged.append)
    assert len(ds) == report.kept == len(good)
    assert report.total == len(good) + len(bad)
    assert report.bad == {
        "missing response": 2,
        "empty prompt": 1,
        "wrong type response": 1,
        "wrong type prompt": 1,
        "invalid JSON": 1,
        "not a JSON object": 1,
        "tokenizer error (Exception)": 1,
    }
    # the kept rows are the good ones, in order
    assert [r["input_ids"][2] for r in ds] == [ids(tok, str(d))[0] for d in range(10)]
    assert len(logged) == 1 and "\n" not in logged[0]
    assert f"{len(bad)} malformed" in logged[0] and "missing response: 2" in logged[0]


def test_bad_fraction_over_the_limit_stops(tmp_path, tok):
    rows = [{"prompt": "sort 1 =", "response": "1"}] * 8 + [{"prompt": "sort 1 ="}] * 2
    path = write_lines(tmp_path / "b.jsonl", rows)
    D.load_examples("sft", cfg(max_bad_fraction=0.2), tok, path, log=None)  # 20% is allowed
    with pytest.raises(D.DataError) as info:
        D.load_examples("sft", cfg(max_bad_fraction=0.1), tok, path, log=None)
    message = str(info.value)
    assert "\n" not in message and "2 of 10" in message and "max_bad_fraction=0.1" in message
    assert "missing response: 2" in message and path in message


def test_custom_field_names(tmp_path, tok):
    path = write_lines(tmp_path / "c.jsonl", [{"q": "sort 2 1 =", "a": "1 2"}])
    ds, _ = D.load_examples("sft", cfg(prompt_field="q", response_field="a"), tok, path, log=None)
    assert len(ds) == 1
    with pytest.raises(D.DataError, match="missing prompt"):
        D.load_examples("sft", cfg(), tok, path, log=None)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_truncate_vs_drop(tmp_path, tok, overlong):
    max_len = 9
    rows = []
    for n in range(1, 9):  # prompt: bos sort d*n = (n + 3) tokens; response: n digits + eos
        digits = " ".join(["1"] * n)
        rows.append({"prompt": f"sort {digits} =", "response": digits})
    path = write_lines(tmp_path / "long.jsonl", rows)
    lengths = [(n + 3, 2 * n + 4) for n in range(1, 9)]  # (prompt tokens, total tokens)
    fits = sum(total <= max_len for _, total in lengths)
    cuttable = sum(total > max_len and p < max_len for p, total in lengths)
    ds, report = D.load_examples("sft", cfg(max_seq_len=max_len, overlong=overlong), tok, path, log=None)
    if overlong == "drop":
        assert (report.truncated, report.dropped_overlong, report.kept) == (0, 8 - fits, fits)
    else:
        assert (report.truncated, report.dropped_overlong) == (cuttable, 8 - fits - cuttable)
        assert report.kept == fits + cuttable
    assert all(len(r["input_ids"]) <= max_len and sum(r["loss_mask"]) > 0 for r in ds)
    assert f"{report.truncated} truncated and {report.dropped_overlong} dropped" in report.summary()


def test_nothing_usable_is_an_error(tmp_path, tok):
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "sort 1 2 3 =", "response": "1 2 3"}])
    with pytest.raises(D.DataError, match="none of the 1 rows"):
        D.load_examples("sft", cfg(max_seq_len=4, overlong="drop"), tok, path, log=None)


@pytest.mark.parametrize("text", ["", "\n\n   \n", "\n"])
@pytest.mark.parametrize("kind", ["sft", "preference", "prompt"])
def test_empty_or_blank_file_is_one_data_error(tmp_path, tok, text, kind):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(D.DataError, match=r"no rows \(the file is empty or holds only blank lines\)"):
        D.load_examples(kind, cfg(), tok, str(path), log=None)


def test_an_empty_file_among_others_is_skipped(tmp_path, tok):
    write_lines(tmp_path / "a.jsonl", [{"prompt": "sort 1 2 =", "response": "1 2"}])
    (tmp_path / "b.jsonl").write_text("")
    ds, report = D.load_examples("sft", cfg(), tok, str(tmp_path / "*.jsonl"), log=None)
    assert len(ds) == 1 and report.total == 1


# ---------------------------------------------------------------------------------------------
# Chat rows
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tok():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>", "system", "user", "assistant", "<end>"] + [f"w{i}" for i in range(30)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    t.chat_template = (
        "<bos> {% for m in messages %}{{ m['role'] }} {{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    return t


def test_chat_loss_on_assistant_tokens_only(tmp_path, chat_tok):
    messages = [
        {"role": "system", "content": "w1"},
        {"role": "user", "content": "w2 w3"},
        {"role": "assistant", "content": "w4 w5"},
        {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7"},
    ]
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": messages}])
    ds, _ = D.load_examples("sft", cfg(), chat_tok, path, log=None)
    row = ds[0]
    words = chat_tok.convert_ids_to_tokens(row["input_ids"])
    learned = [w for w, m in zip(words, row["loss_mask"]) if m]
    # exactly the assistant contents and their end-of-turn markers
    assert learned == ["w4", "w5", "<end>", "w7", "<end>"]
    assert words.count("w2") == 1 and row["loss_mask"][words.index("w2")] == 0
    assert row["loss_mask"][words.index("assistant")] == 0  # the role header is prompt


def test_chat_prompt_completion_rows_learn_the_completion_only(tmp_path, chat_tok):
    """prompt and response as message lists (TRL's prompt-completion form, data.response_field=completion):
    the same tokens as the whole conversation in `messages`, the loss on the completion's turns alone."""
    prompt = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"},
              {"role": "user", "content": "w3"}]
    completion = [{"role": "assistant", "content": "w4 w5"}]
    rows = [{"messages": prompt + completion}, {"prompt": prompt, "completion": completion},
            {"prompt": prompt, "completion": [{"role": "user", "content": "w6"}]}]
    path = write_lines(tmp_path / "pc.jsonl", rows)
    ds, report = D.load_examples("sft", cfg(max_bad_fraction=1.0, response_field="completion"), chat_tok, path,
                                 log=None)
    assert report.bad == {"no assistant message": 1}
    whole, split = ds[0], ds[1]
    assert split["input_ids"] == whole["input_ids"]
    learned = [w for w, m in zip(chat_tok.convert_ids_to_tokens(split["input_ids"]), split["loss_mask"]) if m]
    assert learned == ["w4", "w5", "<end>"]  # the prompt's assistant turn w2 is context, not learned
    assert sum(whole["loss_mask"]) == sum(split["loss_mask"]) + 2


def test_chat_malformed_rows(tmp_path, chat_tok):
    ok = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}
    rows = [
        ok,
        {"messages": [{"role": "user", "content": "w1"}]},  # nothing to learn
        {"messages": []},
        {"messages": "w1"},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "w2"}]},
    ]
    path = write_lines(tmp_path / "chat_bad.jsonl", rows)
    ds, report = D.load_examples("sft", cfg(max_bad_fraction=1.0), chat_tok, path, log=None)
    assert len(ds) == 1
    assert report.bad == {
        "no assistant message": 1,
        "empty messages": 1,
        "wrong type messages": 1,
        "malformed messages (need role and content strings)": 1,
    }


def test_chat_template_that_rewrites_history_is_rejected(tmp_path, chat_tok):
    import copy

    t = copy.deepcopy(chat_tok)
    # drops earlier assistant turns from the rendering: renderings are not prefixes of each other
    t.chat_template = (
        "<bos> {% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] }} {{ m['content'] }} <end> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    msgs = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"},
            {"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]
    path = write_lines(tmp_path / "chat_unstable.jsonl", [{"messages": msgs}])
    with pytest.raises(D.DataError, match="not prefix-stable"):
        D.load_examples("sft", cfg(), t, path, log=None)


def test_chat_rows_need_a_template(tmp_path, tok):
    msgs = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "1"}]
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": msgs}])
    with pytest.raises(D.DataError, match="no chat template"):
        D.load_examples("sft", cfg(), tok, path, log=None)


@pytest.fixture(scope="module")
def strict_chat_tok(chat_tok):
    """chat_tok whose template raises, as real ones do, for a role it does not know and for two user turns in a row."""
    import copy

    t = copy.deepcopy(chat_tok)
    t.chat_template = (
        "<bos> {% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}"
        "{% endif %}{% if loop.index0 > 0 and m['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] }} {{ m['content'] }} <end> {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
    )
    return t


@pytest.mark.parametrize("kind", ["sft", "prompt"])
def test_rows_the_chat_template_cannot_render_are_counted_with_one_warning(tmp_path, strict_chat_tok, kind):
    ok = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}
    tool = {"messages": [{"role": "tool", "content": "w3"}, {"role": "assistant", "content": "w4"}]}
    twice = {"messages": [{"role": "user", "content": "w1"}, {"role": "user", "content": "w5"},
                          {"role": "assistant", "content": "w6"}]}
    path = write_lines(tmp_path / "chat.jsonl", [ok, tool, ok, twice, ok])
    logged = []
    ds, report = D.load_examples(kind, cfg(max_bad_fraction=0.5), strict_chat_tok, path, log=logged.append)
    assert len(ds) == report.kept == 3
    assert report.bad == {"chat template error (TemplateError)": 2}
    assert report.template_rows == [2, 4]
    warnings = [line for line in logged if line.startswith("warning:")]
    assert len(logged) == 2 and len(warnings) == 1 and "\n" not in warnings[0]
    assert path in warnings[0] and "2 of 5 rows" in warnings[0] and "rows 2, 4" in warnings[0]
    assert "Unknown role: tool" in warnings[0]  # the template's own error, of the first row it failed on
    assert "2 malformed skipped (chat template error (TemplateError): 2)" in logged[0]


def test_over_the_bad_fraction_the_error_quotes_the_template(tmp_path, strict_chat_tok):
    ok = {"messages": [{"role": "user", "content": "w1"}]}
    tool = {"messages": [{"role": "tool", "content": "w3"}]}
    path = write_lines(tmp_path / "chat.jsonl", [ok, ok, tool])
    with pytest.raises(D.DataError) as info:
        D.load_examples("prompt", cfg(max_bad_fraction=0.1), strict_chat_tok, path, log=None)
    message = str(info.value)
    assert "\n" not in message and "1 of 3 rows" in message and "row 3: TemplateError: Unknown role: tool" in message


@pytest.mark.parametrize("max_bad_fraction", [0.0, 1.0])
def test_all_rows_bad_is_one_error_naming_what_is_wrong(tmp_path, tok, strict_chat_tok, max_bad_fraction):
    tool = {"messages": [{"role": "tool", "content": "w3"}]}
    path = write_lines(tmp_path / "chat.jsonl", [tool, tool])
    with pytest.raises(D.DataError) as info:
        D.load_examples("prompt", cfg(max_bad_fraction=max_bad_fraction), strict_chat_tok, path, log=None)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"data {path}: all 2 rows are malformed")
    assert "row 1: TemplateError: Unknown role: tool" in message and "data.max_seq_len" not in message
    # other malformed rows too: not the over-long rows' fix (raise data.max_seq_len)
    path = write_lines(tmp_path / "sft.jsonl", [{"prompt": "sort 1 ="}, {"prompt": "sort 2 ="}])
    with pytest.raises(D.DataError, match=r"all 2 rows are malformed \(missing response: 2\): fix the data") as info:
        D.load_examples("sft", cfg(max_bad_fraction=max_bad_fraction), tok, path, log=None)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Preference and prompt rows
# ---------------------------------------------------------------------------------------------


def test_preference_rows(tmp_path, tok):
    rows = [
        {"prompt": "sort 2 1 =", "chosen": "1 2", "rejected": "2"},
        {"prompt": "sort 2 1 =", "chosen": "1 2", "rejected": "1 2"},  # no signal
        {"prompt": "sort 2 1 =", "chosen": "1 2"},  # missing rejected
    ]
    path = write_lines(tmp_path / "p.jsonl", rows)
    ds, report = D.load_examples("preference", cfg(max_bad_fraction=1.0), tok, path, log=None)
    assert len(ds) == 1 and report.bad == {"chosen equals rejected": 1, "missing rejected": 1}
    row = ds[0]
    prompt = ids(tok, "sort 2 1 =", special=True)
    assert row["prompt_len"] == len(prompt)
    assert row["chosen_ids"] == prompt + ids(tok, "1 2") + [tok.eos_token_id]
    assert row["rejected_ids"] == prompt + ids(tok, "2") + [tok.eos_token_id]


def test_conversational_preference_rows(tmp_path, chat_tok):
    """chosen/rejected as message lists (preference datasets on the Hub): whole conversations sharing the turns
    before the answer, or answer turns after a prompt of messages. The prompt is rendered as PPO renders it
    (generation prompt), and each answer ends after its first EOS, or gets one (data.append_eos)."""
    import copy

    user = {"role": "user", "content": "w1 w2"}
    good, bad = {"role": "assistant", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}
    rows = [
        {"prompt": "w1 w2", "chosen": [user, good], "rejected": [user, bad]},  # whole conversations
        {"prompt": [user], "chosen": [good], "rejected": [bad]},  # the prompt as turns
        {"chosen": [user, good], "rejected": [{"role": "user", "content": "w9"}, bad]},
        {"chosen": [good], "rejected": [bad]},
        {"prompt": [user], "chosen": [good], "rejected": [good]},
        {"prompt": [user], "chosen": [user], "rejected": [bad]},
        {"prompt": [user], "chosen": [good]},
    ]
    path = write_lines(tmp_path / "chat_pairs.jsonl", rows)
    ds, report = D.load_examples("preference", cfg(max_bad_fraction=1.0), chat_tok, path, log=None)
    assert report.bad == {"chosen and rejected differ before their last turn": 1,
                          "no turns before the answer in chosen": 1, "chosen equals rejected": 1,
                          "chosen and rejected must end in one assistant turn each": 1, "missing rejected": 1}
    head = ["<bos>", "user", "w1", "w2", "<end>", "assistant"]
    rendered = chat_tok.apply_chat_template([user], add_generation_prompt=True, return_dict=False)
    assert chat_tok.convert_ids_to_tokens(rendered) == head
    for row in ds:
        assert row["prompt_len"] == len(head)
        assert chat_tok.convert_ids_to_tokens(row["chosen_ids"]) == head + ["w3", "<end>", "<eos>"]
        assert chat_tok.convert_ids_to_tokens(row["rejected_ids"]) == head + ["w4", "w5", "<end>", "<eos>"]
    # A template that ends each turn with EOS (ChatML's <|im_end|>) and more: the answer stops after the EOS.
    eos_tok = copy.deepcopy(chat_tok)
    eos_tok.chat_template = chat_tok.chat_template.replace("<end>", "<eos> <end>")
    ds, _ = D.load_examples("preference", cfg(max_bad_fraction=1.0), eos_tok, path, log=None)
    assert eos_tok.convert_ids_to_tokens(ds[0]["chosen_ids"]) == [
        "<bos>", "user", "w1", "w2", "<eos>", "<end>", "assistant", "w3", "<eos>"]


def test_a_prompt_of_messages_renders_as_a_messages_row(tmp_path, chat_tok):
    turns = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}]
    path = write_lines(tmp_path / "q.jsonl", [{"messages": turns}, {"prompt": turns}, {"prompt": [{"role": "user"}]}])
    ds, report = D.load_examples("prompt", cfg(max_bad_fraction=1.0), chat_tok, path, log=None)
    assert report.bad == {"malformed prompt (need role and content strings)": 1}
    assert ds[0]["prompt_ids"] == ds[1]["prompt_ids"] == chat_tok.apply_chat_template(
        turns, add_generation_prompt=True, return_dict=False)


def test_conversational_pairs_of_the_real_model_end_at_its_eos(tmp_path, smollm2):
    """SmolLM2's ChatML: the prompt ends with the generation prompt, the answer with <|im_end|> (no newline)."""
    from transformers import AutoTokenizer

    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR

    real = AutoTokenizer.from_pretrained(smollm2["megatron"] / TOKENIZER_DIR)
    user = {"role": "user", "content": "Sort 3 1 2"}
    row = {"chosen": [user, {"role": "assistant", "content": "1 2 3"}],
           "rejected": [user, {"role": "assistant", "content": "3 2 1"}]}
    ds, _ = D.load_examples("preference", cfg(max_seq_len=256), real, write_lines(tmp_path / "p.jsonl", [row]),
                            log=None)
    n = ds[0]["prompt_len"]
    prompt = real.decode(ds[0]["chosen_ids"][:n])
    assert prompt.endswith("<|im_start|>user\nSort 3 1 2<|im_end|>\n<|im_start|>assistant\n"), prompt
    assert real.decode(ds[0]["chosen_ids"][n:]) == "1 2 3<|im_end|>"
    assert real.decode(ds[0]["rejected_ids"][n:]) == "3 2 1<|im_end|>"


def test_preference_truncation_that_removes_the_difference_drops(tmp_path, tok):
    rows = [{"prompt": "sort 2 1 =", "chosen": "1 2 3", "rejected": "1 2 4"}]  # 5 prompt tokens; differ at index 7
    path = write_lines(tmp_path / "p.jsonl", rows)
    ds, report = D.load_examples("preference", cfg(max_seq_len=8), tok, path, log=None)
    assert report.truncated == 1 and len(ds[0]["chosen_ids"]) == 8
    assert ds[0]["chosen_ids"] != ds[0]["rejected_ids"]
    with pytest.raises(D.DataError, match="none of the 1 rows"):
        D.load_examples("preference", cfg(max_seq_len=7), tok, path, log=None)


def test_overlong_prompts_keep_their_start_and_end_with_a_warning(tmp_path, tok):
    """Issue 22, item 9: BOS + the instruction (start) and the generation cue (end) survive; the middle goes."""
    path = write_lines(tmp_path / "q.jsonl", [{"prompt": "sort 1 2 3 4 5 ="}, {"prompt": "sort 1 ="}])
    logged = []
    ds, report = D.load_examples("prompt", cfg(max_seq_len=32, max_prompt_len=5), tok, path, log=logged.append)
    assert report.truncated == 1
    assert ds[0]["prompt_ids"] == ids(tok, "sort 1 5 =", special=True)  # <bos> sort 1 | 2 3 4 dropped | 5 =
    assert ds[0]["prompt_ids"][0] == tok.bos_token_id
    assert ds[1]["prompt_ids"] == ids(tok, "sort 1 =", special=True)
    assert logged[1] == (f"warning: data {path}: 1 of 2 prompt examples are longer than 5 tokens and were cut in the "
                         "middle (their first 3 and last 2 tokens kept): raise data.max_prompt_len, or set "
                         "data.overlong=drop to skip them")
    logged.clear()
    D.load_examples("prompt", cfg(max_seq_len=32), tok, path, log=logged.append)
    assert len(logged) == 1  # nothing truncated: the summary alone


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def test_formats_give_the_same_examples(tmp_path, tok):
    import datasets

    rows = [{"prompt": f"sort {a} {b} =", "response": f"{min(a, b)} {max(a, b)}"} for a in range(4) for b in range(3)]
    jsonl = write_lines(tmp_path / "x.jsonl", rows)
    (tmp_path / "x.json").write_text(json.dumps(rows))
    raw = datasets.Dataset.from_list(rows)
    raw.to_parquet(str(tmp_path / "x.parquet"))
    raw.save_to_disk(str(tmp_path / "saved"))
    expected = D.load_examples("sft", cfg(), tok, jsonl, log=None)[0]["input_ids"]
    for path in ("x.json", "x.parquet", "saved"):
        got = D.load_examples("sft", cfg(), tok, str(tmp_path / path), log=None)[0]["input_ids"]
        assert got == expected, path
    # a glob over two files concatenates them in sorted order
    write_lines(tmp_path / "y.jsonl", rows[:3])
    both = D.load_examples("sft", cfg(), tok, str(tmp_path / "*.jsonl"), log=None)[0]
    assert len(both) == len(rows) + 3
    with pytest.raises(D.DataError, match="data.format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        D.read_rows(str(tmp_path / "x.csv"))


def test_parquet_wrongly_typed_column_is_bad_rows(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list([{"prompt": "sort 1 =", "response": 1}] * 3).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(D.DataError, match="wrong type response: 3"):
        D.load_examples("sft", cfg(), tok, str(tmp_path / "t.parquet"), log=None)


def test_eval_fraction_split_is_seeded_and_disjoint(tmp_path, tok):
    rows = [{"prompt": f"sort {i % 10} {i // 10} =", "response": f"{i % 10}"} for i in range(50)]
    path = write_lines(tmp_path / "s.jsonl", rows)
    a = D.load_splits("sft", cfg(train_path=path, eval_fraction=0.2), tok, log=None)
    b = D.load_splits("sft", cfg(train_path=path, eval_fraction=0.2), tok, log=None)
    c = D.load_splits("sft", cfg(train_path=path, eval_fraction=0.2, seed=1), tok, log=None)
    key = lambda ds: [tuple(r["input_ids"]) for r in ds]  # noqa: E731
    assert len(a.eval) == 10 and len(a.train) == 40
    assert key(a.eval) == key(b.eval) and key(a.eval) != key(c.eval)
    assert not set(key(a.eval)) & set(key(a.train))


# ---------------------------------------------------------------------------------------------
# Collation
# ---------------------------------------------------------------------------------------------


def test_collate_sft_shifts_targets_and_pads_right():
    examples = [{"input_ids": [1, 5, 6, 7], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [1, 8], "loss_mask": [0, 1]}]
    b = collate_sft(examples, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7], [1, 8, 0, 0]]
    assert b["labels"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    # the loss at t predicts token t+1, so it is on where token t+1 is a response token
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert b["loss_mask"].dtype == torch.float32
    assert b["attention_mask"].tolist() == [[True] * 4, [True, True, False, False]]
    assert b["lengths"].tolist() == [4, 2] and b["position_ids"][1].tolist() == [0, 1, 2, 3]
    assert collate_sft(examples, pad_id=0, multiple_of=3)["input_ids"].shape == (2, 6)
    assert collate_sft(examples, pad_id=0, pad_to=8)["labels"].shape == (2, 8)
    with pytest.raises(ValueError, match="pad_to=3"):
        collate_sft(examples, pad_id=0, pad_to=3)


def test_collate_preference_stacks_chosen_then_rejected():
    examples = [
        {"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2], "prompt_len": 1},
        {"chosen_ids": [1, 4], "rejected_ids": [1, 5, 6, 7], "prompt_len": 1},
    ]
    b = collate_preference(examples, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0], [1, 4, 0, 0], [1, 2, 0, 0], [1, 5, 6, 7]]
    assert b["lengths"].tolist() == [3, 2, 2, 4] and b["prompt_lens"].tolist() == [1, 1]
    last = b["input_ids"].gather(1, (b["lengths"] - 1).unsqueeze(1)).squeeze(1)
    assert last.tolist() == [3, 4, 2, 7]


def test_collate_prompts_left_pads():
    b = collate_prompts([{"prompt_ids": [1, 3, 4]}, {"prompt_ids": [1, 5]}], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 3, 4], [0, 1, 5]]
    assert b["attention_mask"].tolist() == [[True, True, True], [False, True, True]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


def test_microbatches_split_this_ranks_share(tmp_path, tok):
    rows = [{"prompt": f"sort {i} =", "response": f"{i}"} for i in range(8)]
    ds, _ = D.load_examples("sft", cfg(), tok, write_lines(tmp_path / "m.jsonl", rows), log=None)
    mbs = microbatches(ds, [5, 1, 2, 7], 2, collate_sft, pad_id=tok.pad_token_id)
    assert len(mbs) == 2 and mbs[0]["input_ids"].shape[0] == 2
    assert mbs[0]["input_ids"][0].tolist() == ds[5]["input_ids"]
    with pytest.raises(ValueError):
        microbatches(ds, [1, 2, 3], 2, collate_sft, pad_id=0)
