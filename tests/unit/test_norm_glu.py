"""models/norm_glu.py: RMSNorm and SwiGLU with one autograd node each compute what torch's RMSNorm and
Megatron's `glu` compute (forward bit for bit; RMSNorm's gradients as close to float64 as torch's, SwiGLU's
equal), and the CPU layer spec builds them without changing the model's function or its state dict."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models.norm_glu import RMSNorm, SwiGLU

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer spec is off with CUDA")


def _megatron_glu(x):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_torch_forward_and_its_gradients_are_as_accurate(dtype):
    g = torch.Generator().manual_seed(0)
    x0 = (3 * torch.randn(9, 4, 96, generator=g)).to(dtype)
    grad = torch.randn(9, 4, 96, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    x64 = x0.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64).backward(grad.double())
    results = {}
    for name, module in (("torch", torch.nn.RMSNorm(96, eps=1e-5)), ("ours", RMSNorm(None, hidden_size=96, eps=1e-5))):
        module = module.to(dtype)
        with torch.no_grad():
            module.weight.copy_(weight)
        x = x0.clone().requires_grad_()
        y = module(x)
        y.backward(grad)
        assert y.dtype == x.grad.dtype == module.weight.grad.dtype == dtype
        results[name] = (y.detach(), x.grad, module.weight.grad)
    assert torch.equal(results["ours"][0], results["torch"][0])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # relative to the gradient's scale
    for i, exact in ((1, x64.grad), (2, w64.grad)):
        err = {name: (r[i].double() - exact).abs().max().item() for name, r in results.items()}
        assert err["ours"] <= 1.5 * err["torch"] + 1e-12, err
        assert err["ours"] <= tolerance * exact.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_megatrons_glu_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(1)
    x0 = (2 * torch.randn(7, 3, 2 * 40, generator=g)).to(dtype)
    grad = torch.randn(7, 3, 40, generator=g).to(dtype)
    results = []
    for fn in (SwiGLU(), _megatron_glu):
        x = x0.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        results.append((y.detach(), x.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_swiglu_refuses_a_config_it_does_not_compute():
    from types import SimpleNamespace

    ok = dict(activation_func=F.silu, gated_linear_unit=True, glu_linear_offset=0.0, activation_func_clamp_value=None)
    SwiGLU(config=SimpleNamespace(**ok))
    for change in (dict(activation_func=F.gelu), dict(glu_linear_offset=1.0), dict(activation_func_clamp_value=7.0)):
        with pytest.raises(ValueError, match="SwiGLU needs activation_func=F.silu"):
            SwiGLU(config=SimpleNamespace(**{**ok, **change}))


def test_the_cpu_model_uses_them_with_the_same_function_and_state_dict(world):
    """A model built by models/build.py against the same weights in torch's RMSNorm and Megatron's glu."""
    from megatron_rlhf.models.build import build_model_chunk
    from megatron_rlhf.models.spec import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                      vocab_size=29, max_position_embeddings=32, init_method_std=0.2)
    torch.manual_seed(0)
    ours = build_model_chunk(cfg, _parallel())
    layers = ours.decoder.layers
    assert ours.config.use_te_activation_func
    assert all(type(m) is RMSNorm for layer in layers for m in (layer.input_layernorm, layer.pre_mlp_layernorm))
    assert all(type(layer.mlp.activation_func) is SwiGLU for layer in layers)
    torch.manual_seed(0)
    plain = build_model_chunk(cfg, _parallel())
    plain.load_state_dict(ours.state_dict())
    for layer in plain.decoder.layers:  # back to torch's norm and Megatron's glu, the same weights
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            norm = getattr(layer, name)
            norm.__class__ = torch.nn.RMSNorm
        del layer.mlp.activation_func  # a child module: a plain function cannot take its place directly
        layer.mlp.activation_func = _megatron_glu
    assert ours.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 29, (3, 11), generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(11).expand(3, -1)
    outputs = []
    for model in (ours, plain):
        logits = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
        (logits.float().square().mean()).backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(outputs[0][0], outputs[1][0])
    for name, grad in outputs[0][1].items():
        torch.testing.assert_close(grad, outputs[1][1][name], rtol=1e-5, atol=1e-7, msg=name)


def _parallel():
    from megatron_rlhf.parallel.layout import ParallelConfig

    return ParallelConfig()
