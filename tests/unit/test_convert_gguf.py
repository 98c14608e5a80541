"""Conversion from GGUF (`--gguf`): the real SmolLM2-135M-Instruct file round-trips to HF bit for bit with
its tokenizer and chat template; files that cannot be converted are one error line, before any loading."""

import json

import pytest
import torch

from megatron_rlhf.checkpoint import convert_cli
from megatron_rlhf.checkpoint.hf import META_FILE, TOKENIZER_DIR


def _error(capsys, argv):
    assert convert_cli.hf_to_megatron_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_gguf_converts_with_its_tokenizer_and_round_trips(smollm2):
    """`smollm2` (tests/conftest.py) ran `--gguf` through the command line and exported the result back to HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, gguf_file = smollm2["megatron"], smollm2["gguf"]
    meta = json.loads((out / META_FILE).read_text())
    cfg = meta["model_config"]
    assert (cfg["hidden_size"], cfg["num_layers"], cfg["num_attention_heads"], cfg["num_query_groups"],
            cfg["ffn_hidden_size"], cfg["vocab_size"]) == (576, 30, 9, 3, 1536, 49152)
    assert cfg["tie_embeddings"] and cfg["rotary_base"] == 100000.0 and meta["dtype"] == "float32"
    assert meta["source"] == str(gguf_file.absolute())
    assert not list(smollm2["dir"].glob(".gguf-*"))  # the dequantised HF copy is gone
    assert "%|" not in smollm2["convert_stderr"], smollm2["convert_stderr"][-500:]  # --quiet: no progress bar

    tok = AutoTokenizer.from_pretrained(out / TOKENIZER_DIR)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "Sort 7 3 9 1"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")

    ours = AutoModelForCausalLM.from_pretrained(smollm2["hf"], dtype=torch.float32).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32).state_dict()
    assert set(ours) == set(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_a_quantisation_that_cannot_be_dequantised_is_one_line(tmp_path, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((2, type_size), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    err = _error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o")])
    assert "token_embd.weight is quantised as Q8_1" in err and "cannot dequantise" in err
    assert not (tmp_path / "o").exists()


def test_not_a_gguf_and_a_missing_file_are_one_line(tmp_path, capsys):
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf file\n")
    assert "is not a readable GGUF file" in _error(capsys, ["--gguf", str(text), "--out", str(tmp_path / "o")])
    assert "does not exist" in _error(capsys, ["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):  # --hf-dir and --gguf together: argparse's usage error
        convert_cli.hf_to_megatron_main(["--gguf", str(text), "--hf-dir", str(tmp_path), "--out", str(tmp_path / "o")])


def test_an_existing_output_is_refused_before_loading(smollm2_gguf, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("x")
    err = _error(capsys, ["--gguf", str(smollm2_gguf), "--out", str(tmp_path / "o")])
    assert "--overwrite" in err
