"""Tiny random HF models built offline (no downloads) for the conversion tests, plus their references.

Sizes: hidden 64, 2 layers, 4 heads, vocab 101 (odd, so TP=2 pads it to 102 and trimming is exercised),
FFN 96; TP=2 divides heads, query groups and FFN; PP=2 gives one layer per stage.
Each model differs where conversions go wrong:
- llama: GQA (4 heads, 2 groups), llama3 rope scaling with a large theta, sharded safetensors + index.
- mistral: head_dim 32 != hidden/heads (Q = 128 != hidden 64), sliding_window=None.
- qwen2: QKV bias, tied embeddings, MHA (4 query groups).
- llama_rm: LlamaForSequenceClassification (score [1, H]) with right padding; pad id 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 101
PAD = 0


def _common(**kw):
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    base.update(kw)
    return base


def build(name: str):
    """A fresh random HF model (eval mode, fp32) for `name`."""
    import transformers as tr

    torch.manual_seed(sum(map(ord, name)))  # stable across processes (unlike hash())
    if name == "llama":
        cfg = tr.LlamaConfig(
            **_common(num_key_value_heads=2, max_position_embeddings=16384),  # > llama3's original 8192
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        model = tr.LlamaForCausalLM(cfg)
    elif name == "mistral":
        cfg = tr.MistralConfig(**_common(num_key_value_heads=2, head_dim=32), sliding_window=None)
        model = tr.MistralForCausalLM(cfg)
    elif name == "qwen2":
        cfg = tr.Qwen2Config(**_common(num_key_value_heads=4), tie_word_embeddings=True)
        model = tr.Qwen2ForCausalLM(cfg)
    elif name == "llama_rm":
        cfg = tr.LlamaConfig(**_common(num_key_value_heads=2), num_labels=1, pad_token_id=PAD)
        model = tr.LlamaForSequenceClassification(cfg)
    else:
        raise KeyError(name)
    # Random init leaves norms at 1 and some biases at 0; perturb everything so a swapped or
    # dropped tensor shows up in the outputs.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def tokens() -> torch.Tensor:
    """[2, 12] token ids; the second row is right-padded with PAD after 8 tokens."""
    g = torch.Generator().manual_seed(7)
    t = torch.randint(1, VOCAB, (2, 12), generator=g)
    t[1, 8:] = PAD
    return t


def last_real(t: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token per row (where HF pools the sequence score)."""
    idx = torch.arange(t.shape[1])
    return (idx * (t != PAD)).argmax(-1)


@torch.no_grad()
def save(name: str, out: Path, **save_kw) -> Path:
    """Save model `name` to `out/name` and its reference outputs to `out/name.ref.pt`."""
    model = build(name)
    d = Path(out) / name
    model.save_pretrained(d, **save_kw)
    toks = tokens()
    ref = {"tokens": toks}
    if name.endswith("_rm"):
        ref["scores"] = model(input_ids=toks).logits.float()  # [b, 1], pooled at last_real
    else:
        ref["logits"] = model(input_ids=toks).logits.float()  # [b, s, V]
    torch.save(ref, Path(out) / f"{name}.ref.pt")
    # A tokenizer file must travel with the conversion; any file with the right name will do.
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128, "marker": name}))
    return d


ALL = ("llama", "mistral", "qwen2", "llama_rm")


def save_all(out: Path) -> dict:
    """All four models; llama as 4 safetensors shards with an index."""
    out = Path(out)
    return {n: save(n, out, **({"max_shard_size": "100KB"} if n == "llama" else {})) for n in ALL}
