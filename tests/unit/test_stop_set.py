"""Issue 45 item 6: a response ends at the tokenizer's EOS or any `eos_token_id` of the generation_config.json beside
it (Llama-3.1-Instruct lists 128001, 128008, 128009), in the sampler, the chat preference rows and sampled pairs.
vLLM's engine takes the same set (tests/distributed/scripts/vllm_engine.py)."""

import json

import pytest
import torch

from megatron_rlhf.data import dataset as D
from megatron_rlhf.data import tokenizer as T
from tests.unit.test_data import cfg, chat_tok, write_lines  # noqa: F401 - chat_tok is a fixture
from tests.unit.test_sampler import PAD, _gen, _prompts, model  # noqa: F401 - model is a fixture


def _saved(tok, directory, eos_token_id=None):
    """`tok` saved to `directory` (with a generation_config.json listing `eos_token_id` when given), loaded back."""
    tok.save_pretrained(str(directory))
    if eos_token_id is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return T.load_tokenizer(str(directory))


def test_the_stop_set_is_the_eos_then_the_generation_configs_ids(tmp_path, chat_tok):
    end = chat_tok.convert_tokens_to_ids("<end>")
    assert T.stop_ids(_saved(chat_tok, tmp_path / "none")) == (chat_tok.eos_token_id,)
    assert T.stop_ids(_saved(chat_tok, tmp_path / "one", end)) == (chat_tok.eos_token_id, end)
    listed = _saved(chat_tok, tmp_path / "list", [end, chat_tok.eos_token_id, end])  # repeats and EOS in the list
    assert T.stop_ids(listed) == (chat_tok.eos_token_id, end)
    (tmp_path / "list" / "generation_config.json").write_text("{not json")
    assert T.stop_ids(T.load_tokenizer(str(tmp_path / "list"))) == (chat_tok.eos_token_id,)
    assert T.first_stop([5, 9, end, 2], (2, end)) == 2 and T.first_stop([5, 9], (2, end)) is None


def test_any_id_of_the_stop_set_ends_a_row(model):
    ids, mask = _prompts(2, lengths=(4, 2, 5, 3, 6, 1), extra_pad=1)
    free = _gen(model, ids, mask, greedy=True, max_new_tokens=8)
    rows = free["response_ids"].tolist()
    stops = (int(rows[0][2]), int(rows[1][1]))  # tokens greedy decoding does produce
    out = _gen(model, ids, mask, greedy=True, max_new_tokens=8, eos_id=stops)
    for i, row in enumerate(rows):
        end = T.first_stop(row, stops)
        n = 8 if end is None else end + 1
        assert bool(out["ended"][i]) == (end is not None) and int(out["lengths"][i]) == n, i
        assert out["response_ids"][i, :n].tolist() == row[:n] and out["response_ids"][i, n:].eq(PAD).all(), i
    ended_at = {rows[i][int(out["lengths"][i]) - 1] for i in range(len(rows)) if out["ended"][i]}
    assert ended_at == set(stops)  # each id of the set ended some row: both were honoured
    single = _gen(model, ids, mask, greedy=True, max_new_tokens=8, eos_id=stops[0])
    assert torch.equal(single["ended"], torch.tensor([stops[0] in r for r in rows]))
    with pytest.raises(ValueError, match=r"^eos_id=99 \(a stop id\) is not a token id of the vocabulary"):
        _gen(model, ids, mask, eos_id=(stops[0], 99))


def test_a_chat_preference_answer_ends_at_its_first_stop_id(tmp_path, chat_tok):
    """The template ends each turn with <end>; listed in generation_config.json it ends the answer (where a sampled
    response ends), and no EOS is appended after it. Without the file, EOS is appended (data.append_eos)."""
    user = {"role": "user", "content": "w1"}
    row = {"chosen": [user, {"role": "assistant", "content": "w2 w3"}],
           "rejected": [user, {"role": "assistant", "content": "w4"}]}
    path = write_lines(tmp_path / "p.jsonl", [row])
    end = chat_tok.convert_tokens_to_ids("<end>")
    for name, listed, tail in (("plain", None, ["<end>", "<eos>"]), ("listed", [end], ["<end>"])):
        tok = _saved(chat_tok, tmp_path / name, listed)
        ds, _ = D.load_examples("preference", cfg(max_seq_len=64), tok, path, log=None)
        n = ds[0]["prompt_len"]
        assert tok.convert_ids_to_tokens(ds[0]["chosen_ids"][n:]) == ["w2", "w3", *tail], name
        assert tok.convert_ids_to_tokens(ds[0]["rejected_ids"][n:]) == ["w4", *tail], name


def test_sampled_pairs_cut_responses_at_any_stop_id(tmp_path, chat_tok):
    from megatron_rlhf.trainer import pairs

    end = chat_tok.convert_tokens_to_ids("<end>")
    tok = _saved(chat_tok, tmp_path / "tok", [end])
    scoring = pairs.Scoring("megatron_rlhf.tasks.chat_sort:gold_scores", tok)
    w = tok.convert_tokens_to_ids
    assert scoring.response([w("w2"), end, w("w3")]) == ("w2", True)
    assert scoring.response([w("w2"), tok.eos_token_id]) == ("w2", True)
    assert scoring.response([w("w2"), w("w3")]) == ("w2 w3", False)
    assert pairs.response_text([w("w2"), end], (tok.eos_token_id, end), tok) == ("w2", True)
