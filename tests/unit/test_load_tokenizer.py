"""data/tokenizer.py `load_tokenizer`: a directory whose tokenizer_config.json names the generic fast tokenizer
loads as AutoTokenizer would load it (class, vocabulary, special tokens, chat template, encodings), without
AutoTokenizer; a directory naming another class, or none, still goes through AutoTokenizer."""

import json

import pytest

from megatron_rlhf.data import tokenizer as T


@pytest.fixture
def saved(tmp_path):
    """A word-level fast tokenizer with a chat template, saved as transformers saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>", "user", "assistant"] + [f"w{i}" for i in range(20)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                padding_side="left")
    t.chat_template = "<bos> {% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    t.save_pretrained(tmp_path)
    return tmp_path


def _same(ours, theirs):
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.chat_template == theirs.chat_template
    assert (ours.pad_token_id, ours.eos_token_id, ours.padding_side) == (
        theirs.pad_token_id, theirs.eos_token_id, theirs.padding_side)
    chat = [{"role": "user", "content": "w1 w2"}]
    assert ours.apply_chat_template(chat, tokenize=True) == theirs.apply_chat_template(chat, tokenize=True)
    assert ours("w3 w4 w99").input_ids == theirs("w3 w4 w99").input_ids


def test_the_generic_fast_tokenizer_loads_as_autotokenizer_would(saved, monkeypatch):
    from transformers import AutoTokenizer

    assert T._tokenizer_class(str(saved)) in T.GENERIC_FAST
    theirs = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    if theirs.pad_token_id is None:
        theirs.pad_token = theirs.eos_token  # load_tokenizer's fallback
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _refused)
    _same(T.load_tokenizer(str(saved)), theirs)
    assert theirs.pad_token == "<eos>"


@pytest.mark.parametrize("named", ["LlamaTokenizerFast", None])
def test_another_class_or_none_goes_through_autotokenizer(saved, monkeypatch, named):
    from transformers import AutoTokenizer

    config = json.loads((saved / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class")
    if named:
        config["tokenizer_class"] = named
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    calls = []
    original = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append(a) or original(cls, *a, **k)))
    T.load_tokenizer(str(saved))  # a Llama tokenizer behaves as its own class says, not as tokenizer.json alone
    assert len(calls) == 1


def _refused(*args, **kwargs):
    raise AssertionError("AutoTokenizer was used for the generic fast tokenizer")


def test_a_directory_without_a_tokenizer_is_one_line(tmp_path):
    with pytest.raises(T.DataError, match="^tokenizer.path: could not load a tokenizer from"):
        T.load_tokenizer(str(tmp_path))
