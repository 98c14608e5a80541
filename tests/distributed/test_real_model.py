"""The real pretrained SmolLM2-135M-Instruct (GGUF from the registry, tests/real_model.py) on 2 gloo ranks:
converted with `--gguf`, its Megatron logits on chat-rendered prompts equal transformers' within 1e-4 (fp32)
at TP=1 x DP=2 and at PP=2, loaded from the converted checkpoint and straight from the HF tensors, and
its weights stream back out bit for bit (scripts/convert_parity.py, the same checks as the tiny models)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.checkpoint.convert_cli import hf_to_megatron_main
from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR, megatron_to_hf
from tests.distributed.launch import read_json, torchrun

TOL = 1e-4
QUESTIONS = ("Sort these digits in ascending order: 7 3 9 1", "What is the capital of France?",
             "Write one sentence about the sea.", "List three prime numbers.")


@pytest.fixture(scope="module")
def work(tmp_path_factory, smollm2_gguf):
    """smollm2.mg (converted from the GGUF), smollm2/ (its HF export) and smollm2.ref.pt (transformers' logits)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    w = tmp_path_factory.mktemp("real_model")
    assert hf_to_megatron_main(["--gguf", str(smollm2_gguf), "--out", str(w / "smollm2.mg"), "--quiet"]) == 0
    megatron_to_hf(w / "smollm2.mg", w / "smollm2")
    tok = AutoTokenizer.from_pretrained(w / "smollm2.mg" / TOKENIZER_DIR)
    rows = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            for q in QUESTIONS]
    rows = [r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r for r in rows]
    width = min(len(r) for r in rows)  # same length, no padding: every position is a real token
    tokens = torch.tensor([r[:width] for r in rows])
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(w / "smollm2", dtype=torch.float32)(input_ids=tokens).logits
    torch.save({"tokens": tokens, "logits": logits.float()}, w / "smollm2.ref.pt")
    return w


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_real_model_logits_match_transformers(work, layout):
    out = work / f"{layout}.json"
    torchrun("convert_parity.py", layout, str(work), str(out), "smollm2", nproc=2)
    r = read_json(out)["smollm2"]
    assert r["ckpt_max_diff"] <= TOL, r
    assert r["hf_direct_max_diff"] <= TOL, r
    assert r["stream_names_equal"] and r["stream_shapes_equal"] and r["stream_mismatched"] == [], r
