"""rollout/lean_decode.py against Megatron's own forward (one rank, TP=1; TP=2 is in
tests/distributed/scripts/sampler_tp.py): the same logits at prefill and at every decode step, the
same tokens through `generate`, and the fallback for configs it does not implement."""

import logging

import pytest
import torch

from megatron_rlhf.models.build import build_model_chunk
from megatron_rlhf.models.spec import ModelConfig, transformer_config
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.lean_decode import LeanDecoder
from megatron_rlhf.rollout.megatron_engine import ModuleDecoder, decode_path, generate

VOCAB = 23
BASE = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
            vocab_size=VOCAB, max_position_embeddings=64, init_method_std=0.2)
CASES = {  # name -> (ModelConfig overrides, TransformerConfig overrides, GPTModel overrides)
    "untied_gqa": ({}, {}, {}),
    "tied": (dict(tie_embeddings=True), {}, {}),
    "biases_llama3_rope": (dict(add_qkv_bias=True, rope_scaling={"type": "llama3", "factor": 8.0}, rotary_base=500.0),
                           dict(add_bias_linear=True), {}),
    "interleaved_half_rope_linear_scaling": (dict(num_query_groups=1, rope_scaling={"type": "linear", "factor": 2.0}),
                                             dict(rotary_interleaved=True), dict(rotary_percent=0.5)),
}


def _model(seed=0, cfg=None, config_overrides=None, gpt_overrides=None):
    """A GPTModel of the local spec, built as models/build.py builds it (plus GPTModel-only settings)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_rlhf.models.spec import layer_spec

    cfg = cfg or ModelConfig(**BASE)
    parallel = ParallelConfig()
    config = transformer_config(cfg, parallel, **(config_overrides or {}))
    torch.manual_seed(seed)
    if not gpt_overrides:
        return build_model_chunk(cfg, parallel, config=config).eval()
    rope = cfg.rope_scaling or {}
    return GPTModel(config=config, transformer_layer_spec=layer_spec(), vocab_size=cfg.padded_vocab_size(1),
                    max_sequence_length=cfg.max_position_embeddings, share_embeddings_and_output_weights=cfg.tie_embeddings,
                    position_embedding_type="rope", rotary_base=cfg.rotary_base,
                    seq_len_interpolation_factor=rope.get("factor") if rope.get("type") == "linear" else None,
                    **gpt_overrides).eval()


def _logit_gaps(model, b=3, prefill=5, steps=6, seed=0):
    """max |lean - Megatron| of next-token logits at prefill and at each following step -> list of floats."""
    g = torch.Generator().manual_seed(seed)
    width = prefill + steps + 1
    seq = torch.randint(0, VOCAB, (b, width), generator=g)
    pos = torch.arange(width).expand(b, -1)
    with torch.no_grad():
        ref, lean = ModuleDecoder(model, b, width), LeanDecoder(model, b, width)
        gaps = [(ref.prefill(seq[:, :prefill], pos[:, :prefill]) - lean.prefill(seq[:, :prefill], pos[:, :prefill]))
                .abs().max().item()]
        for t in range(prefill, prefill + steps):
            a, c = ref.step(seq[:, t:t + 1], pos[:, t:t + 1]), lean.step(seq[:, t:t + 1], pos[:, t:t + 1])
            assert a.shape == c.shape == (b, VOCAB)
            gaps.append((a - c).abs().max().item())
    return gaps


@pytest.mark.parametrize("case", CASES)
def test_lean_logits_equal_megatron_forward_at_every_step(world, case):
    cfg_kw, config_kw, gpt_kw = CASES[case]
    model = _model(cfg=ModelConfig(**{**BASE, **cfg_kw}), config_overrides=config_kw, gpt_overrides=gpt_kw)
    assert decode_path(model) == "lean"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # Megatron starts them at zero: make them count
                p.normal_(0, 0.5)
    gaps = _logit_gaps(model)
    assert max(gaps) <= 1e-5, gaps
    # Weights are read in place at each decoder build: an optimizer-style in-place update and a
    # swap of a parameter's storage (as weight swaps do) are both seen, and still match Megatron.
    with torch.no_grad():
        model.decoder.layers[0].mlp.linear_fc1.weight.mul_(1.5)
        qkv = model.decoder.layers[1].self_attention.linear_qkv.weight
        qkv.data = qkv.data.flip(0).clone()
    moved = _logit_gaps(model)
    assert max(moved) <= 1e-5, moved


def test_the_comparison_has_teeth(world):
    """A lean forward with one wrong detail (RoPE angles off by one slot) is caught by the comparison."""
    model = _model(1)
    good = LeanDecoder(model, 1, 4)
    bad = LeanDecoder(model, 1, 4)
    bad.cos, bad.signed_sin = bad.cos.roll(1, 0), bad.signed_sin.roll(1, 0)
    tokens, pos = torch.tensor([[3, 5, 7]]), torch.arange(3)[None]
    assert (good.prefill(tokens, pos) - bad.prefill(tokens, pos)).abs().max() > 1e-3


def test_generate_gives_the_same_tokens_through_both_paths(world):
    model = _model(2, cfg=ModelConfig(**{**BASE, "tie_embeddings": True}))
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([5, 1, 7, 3])
    ids = torch.randint(1, VOCAB, (4, 7), generator=g)
    draws = torch.rand(4, 9, generator=g)
    kw = dict(prompt_lengths=lengths, max_new_tokens=9, eos_id=3, pad_id=0, vocab_size=VOCAB, temperature=1.3,
              uniforms=draws)
    lean, module = generate(model, ids, path="lean", **kw), generate(model, ids, path="module", **kw)
    for key in ("response_ids", "response_mask", "ended", "lengths"):
        assert torch.equal(lean[key], module[key]), key
    assert (lean["logprobs"] - module["logprobs"]).abs().max() <= 1e-5
    assert generate(model, ids, **kw)["response_ids"].tolist() == lean["response_ids"].tolist()  # auto = lean
    assert lean["ended"].any() and len({tuple(r) for r in lean["response_ids"].tolist()}) > 1  # not degenerate


def test_unsupported_config_falls_back_and_says_why(world, caplog):
    model = _model(3, cfg=ModelConfig(**{**BASE, "sliding_window": 4}))  # Mistral-style window
    assert decode_path(model).startswith("module: config.window_size=")
    ids, lengths = torch.tensor([[4, 5, 6]]), torch.tensor([3])
    kw = dict(prompt_lengths=lengths, max_new_tokens=3, eos_id=None, pad_id=0, vocab_size=VOCAB, greedy=True)
    with pytest.raises(ValueError, match="does not support this model .config.window_size"):
        generate(model, ids, path="lean", **kw)
    with caplog.at_level(logging.DEBUG, logger="megatron_rlhf.rollout.megatron_engine"):
        auto = generate(model, ids, **kw)
    assert "module forward (config.window_size=" in caplog.text
    assert torch.equal(auto["response_ids"], generate(model, ids, path="module", **kw)["response_ids"])
    with pytest.raises(ValueError, match="path='fast'"):
        generate(model, ids, path="fast", **kw)


def test_bf16_runs_and_stays_close(world):
    model = _model(4, cfg=ModelConfig(**{**BASE, "params_dtype": "bfloat16"}))
    assert decode_path(model) == "lean"
    gaps = _logit_gaps(model, steps=3)
    assert max(gaps) < 0.1, gaps  # bf16 rounding differs in places (keys rotated once, not per step)
    out = generate(model, torch.tensor([[4, 5, 6]]), prompt_lengths=torch.tensor([3]), max_new_tokens=4, eos_id=None,
                   pad_id=0, vocab_size=VOCAB, seed=0)
    assert out["response_ids"].shape == (1, 4) and torch.isfinite(out["logprobs"]).all()


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run under it, and notes each silu whose input is not contiguous."""

    def __init__(self):
        super().__init__()
        self.count, self.strided_silu = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if func.overloadpacket is torch.ops.aten.silu and not args[0].is_contiguous():
            self.strided_silu += 1
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(num_layers: int) -> _Ops:
    model = _model(cfg=ModelConfig(**{**BASE, "num_layers": num_layers}))
    b, n = 8, 5
    decoder = LeanDecoder(model, b, n + 1)
    tokens, pos = torch.randint(0, VOCAB, (b, n + 1)), torch.arange(n + 1).expand(b, -1)
    with torch.no_grad():
        decoder.prefill(tokens[:, :n], pos[:, :n])
        with _Ops() as ops:
            decoder.step(tokens[:, n:], pos[:, n:])
    return ops


# aten ops per layer of one decode step as of this test's writing (2 RMSNorms, QKV, RoPE, the cache writes, SDPA,
# the projection, 3 MLP GEMMs, SwiGLU, 2 residual adds, with their views). Per-op overhead is what the lean forward
# removed from Megatron's module stack (about 85% of a decode step at 16 rows): a change that adds ops to every step
# of every layer must say why, here.
OPS_PER_LAYER = 58


def test_a_decode_step_stays_lean(world):
    """The sampler's speed against transformers (benchmarks/rollout.py) rests on few ops per decode step and
    contiguous element-wise inputs (silu over the strided half of one fc1 output ran ~4x slower at 128 rows)."""
    two, four = _ops_of_one_step(2), _ops_of_one_step(4)
    per_layer = (four.count - two.count) / 2
    assert per_layer <= OPS_PER_LAYER, per_layer
    assert four.count - 4 * per_layer <= 18, four.count  # embedding, RoPE tables, final norm, output layer
    assert four.strided_silu == 0
