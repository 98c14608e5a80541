"""GPU-only paths: Transformer Engine layer spec (+ FP8) and NCCL. Skipped without CUDA/TE.

Run on a GPU node with `torchrun --nproc_per_node 2 -m pytest tests/gpu` for the 2-GPU checks, or
plain `pytest tests/gpu` for the single-GPU ones.
"""

import importlib.util

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")


def tiny(**kw):
    from megatron_rlhf.models.spec import ModelConfig

    base = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                vocab_size=256, max_position_embeddings=128, params_dtype="bfloat16")
    base.update(kw)
    return ModelConfig(**base)


@cuda
def test_cpu_layer_is_off_with_cuda():
    from megatron_rlhf.parallel import cpu

    assert cpu.enable() is False
    assert cpu.transformer_config_overrides() == {}


@cuda
def test_local_spec_model_trains_on_gpu(world_of_one):
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from megatron_rlhf.rollout.megatron_engine import generate

    init.initialize(ParallelConfig(), seed=0)
    model = build_model(tiny(), ParallelConfig())[0]
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # built on the GPU, no .cuda() by the caller
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    # Prompts built on the host, as the data pipeline builds them, with the model on the GPU.
    out = generate(model, ids[:, :8].cpu(), prompt_lengths=torch.tensor([8, 8]), max_new_tokens=4, vocab_size=256,
                   eos_id=None, pad_id=0, greedy=True)
    assert out["response_ids"].shape == (2, 4)


@cuda
@te
@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_te_spec_forward_backward(world_of_one, fp8):
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.models.spec import use_te_spec
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import Fp8Config, ParallelConfig, validate_layout

    assert use_te_spec()
    parallel = ParallelConfig()
    fp8_cfg = Fp8Config(format=fp8)
    validate_layout(parallel, 1, fp8=fp8_cfg)
    init.initialize(parallel, seed=0)
    model = build_model(tiny(), parallel, fp8=fp8_cfg)[0].cuda()
    names = [n for n, _ in model.named_parameters()]
    assert any("linear_qkv.layer_norm_weight" in n for n in names)  # TE-fused norm layout
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss)


@cuda
def test_released_weights_leave_the_gpu_and_come_back_byte_for_byte(world_of_one):
    """rollout.release_training_weights: pinned host copies, device memory given back, every byte restored."""
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from megatron_rlhf.rollout.offload import released

    init.initialize(ParallelConfig(), seed=0)
    model = build_model(tiny(num_layers=4, hidden_size=512, ffn_hidden_size=1024), ParallelConfig())[0].cuda()
    before = [p.detach().clone() for p in model.parameters()]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    with released([model]) as moves:
        assert moves.nbytes == weight_bytes
        assert held - torch.cuda.memory_allocated() >= 0.9 * weight_bytes
    assert torch.cuda.memory_allocated() == held
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@cuda
def test_packed_rows_equal_padded_on_the_gpu(world_of_one):
    """models/packing.py on CUDA (issue 46), fp32 with TF32 off: Transformer Engine's THD attention where TE is
    installed, else the local spec's SDPAttention; the logits of every real token and the scores equal padded within
    1e-5, and changing one packed row leaves the others' logits bit-identical."""
    from megatron_rlhf.models import packing
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig
    from megatron_rlhf.trainer.step import model_forward, pack_widths

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    init.initialize(ParallelConfig(), seed=0)
    model = build_model(tiny(params_dtype="float32"), ParallelConfig())[0].cuda().eval()
    lengths = torch.tensor([5, 40, 2, 17])
    real = torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)
    ids = (torch.randint(1, 256, (4, 40)) * real).cuda()

    def forward(input_ids, packed):
        packing.configure(packed, min_saving=0.0)
        try:
            [mb] = pack_widths([{"input_ids": input_ids, "lengths": lengths}], pipelined=False)
            assert ("pack_width" in mb) == packed
            with torch.no_grad():
                return model_forward(model, mb).float().cpu()
        finally:
            packing.configure(False)

    padded, packed = forward(ids, False), forward(ids, True)
    assert (packed - padded)[real].abs().max() <= 1e-5 * padded[real].abs().max()
    changed = ids.clone()
    changed[1, :40] = torch.randint(1, 256, (40,)).cuda()
    again = forward(changed, True)
    keep = torch.tensor([0, 2, 3])
    assert torch.equal(again[keep][real[keep]], packed[keep][real[keep]])
    assert not torch.equal(again[1], packed[1])
