"""RMSNorm and SwiGLU for the local (non-Transformer-Engine) layer spec on CPU: each one autograd node
with a hand-written backward.

On CPU the local spec runs torch's `RMSNorm`, whose backward autograd assembles from the forward's pieces
(upcast, square, mean, rsqrt, two products, each with its own saved fp32 [.., H] tensor and backward pass),
and Megatron's `glu` (chunk, silu, product), whose backward ends in a `cat` of the two halves' gradients.
These are memory-bound passes between the GEMMs: in a bf16 iteration of the SmolLM2-135M benchmark they are
about 2% of the time (docs/performance.md, runs L and M). Here:

- `RMSNorm` (a `torch.nn.RMSNorm`, so its parameter, state dict and checkpoints are unchanged) computes the
  same forward ops as torch 2.13's CPU `rms_norm` (bit-identical), saves the input and the [.., 1] inverse
  norm, and its backward is the closed form  dx = r (dn - n mean(dn n)),  dw = sum(g n),  with n = x r and
  dn = g w, in fp32 whatever the input dtype (as torch's upcast computes it).
- `SwiGLU` takes fc1's whole [.., 2F] output: silu(gate) * up, as Megatron's `glu`; its backward writes both
  halves' gradients into one [.., 2F] tensor with torch's own `silu_backward`, so the gradients are the
  ones autograd gives Megatron's `glu`, without the `cat`. Megatron's MLP calls a whole-GLU activation
  module only when `use_te_activation_func` is set (its name for "the activation module is the GLU");
  `parallel/cpu.py` sets it on CPU and `models/spec.py` puts `SwiGLU` in the spec.

tests/unit/test_norm_glu.py holds both against torch's modules and float64 references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))  # [.., 1]
        ctx.save_for_backward(x, inv_rms, weight)
        return (x32 * inv_rms * weight).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, inv_rms, weight = ctx.saved_tensors
        normed = x.float() * inv_rms  # n, [.., H] fp32
        g32 = grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g32 * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = g32 * weight  # dn, fp32
            mean_dot = (grad_normed * normed).mean(-1, keepdim=True)  # [.., 1]
            # r (dn - n mean(dn n)), with the product by r folded into both terms: dn r - n (r mean)
            grad_x = torch.addcmul(grad_normed.mul_(inv_rms), normed, inv_rms * mean_dot, value=-1).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` over the last dimension with one autograd node (module docstring).

    Built by Megatron's layer spec as `RMSNorm(config=..., hidden_size=..., eps=...)`. Under sequence
    parallelism each tensor-parallel rank normalises its own slice of the sequence, so its weight gradient is a
    partial sum: the weight is marked `sequence_parallel`, as Megatron's own norms mark theirs, and Megatron's
    `finalize_model_grads` sums it over the tensor-parallel group."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config is not None and config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., H] -> [.., H] in x's dtype."""
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, activated = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = torch.chunk(grad_x, 2, dim=-1)
        torch.mul(grad, up, out=grad_gate)  # d/d silu(gate), then through silu in place:
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        torch.mul(grad, activated, out=grad_up)
        return grad_x


class SwiGLU(torch.nn.Module):
    """fc1's output [.., 2F] (gate then up, per tensor-parallel shard) -> silu(gate) * up [.., F].

    Megatron's MLP builds it as `SwiGLU(config=...)` (module docstring); no parameters."""

    def __init__(self, config=None, **_unused):
        super().__init__()
        if config is not None and (config.activation_func is not F.silu or not config.gated_linear_unit
                                   or config.glu_linear_offset != 0.0 or config.activation_func_clamp_value is not None):
            raise ValueError("SwiGLU needs activation_func=F.silu and gated_linear_unit=True, without "
                             "glu_linear_offset or activation_func_clamp_value")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFunction.apply(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        return {}  # no parameters; Megatron's MLP asks every child module for its shards
