"""trainer/optim.py `use_fused_adam` and checkpoint/optim_state.py keeping that choice across `load_state_dict`."""

from types import SimpleNamespace

import torch

from megatron_rlhf.checkpoint import optim_state
from megatron_rlhf.trainer.optim import use_fused_adam


def _wrapped(**kwargs):
    """A Megatron-like chained optimizer holding one torch AdamW."""
    p = torch.nn.Parameter(torch.randn(5))
    inner = SimpleNamespace(optimizer=torch.optim.AdamW([p], lr=0.1, **kwargs))
    return SimpleNamespace(chained_optimizers=[inner], load_state_dict=inner.optimizer.load_state_dict), p


def test_fused_adam_takes_the_same_steps_and_survives_loading_a_foreach_checkpoint():
    fused, p = _wrapped()
    use_fused_adam(fused)
    group = fused.chained_optimizers[0].optimizer.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False
    plain, q = _wrapped(foreach=True)
    q.data.copy_(p.data)
    for _ in range(3):
        for opt, x in ((fused, p), (plain, q)):
            x.grad = torch.ones_like(x)
            opt.chained_optimizers[0].optimizer.step()
    assert torch.allclose(p, q, atol=1e-6)
    # A checkpoint written by a foreach run: its param groups say foreach; the run keeps its fused kernel.
    kept = optim_state.kernel_flags(fused)
    fused.load_state_dict(plain.chained_optimizers[0].optimizer.state_dict())
    assert fused.chained_optimizers[0].optimizer.param_groups[0]["foreach"] is True
    optim_state.set_kernel_flags(fused, kept)
    group = fused.chained_optimizers[0].optimizer.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False
