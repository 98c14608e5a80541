"""trainer/optim.py `optimizer_step`: the token-count division and the clipping factor applied inside Adam's
pass give the weights that Megatron's own path gives (`finalize_model_grads` dividing the buffers, then
`optimizer.step()` clipping and stepping), in fp32 and bf16, with the distributed optimizer, with clipping
on and off; its grad_norm is Megatron's; a NaN gradient skips the step and leaves everything untouched."""

import pytest
import torch

from megatron_rlhf.trainer.step import make_forward_step, run_schedule, train_step
from tests.unit.test_offload import VOCAB, _loss
from tests.unit.test_offload import _trainable as tiny_trainable



def _trainable(dtype, distributed_optimizer, clip_grad, weights=None, check_for_nan=True):
    t, model = tiny_trainable(dtype, distributed_optimizer, weights, clip_grad, check_for_nan)
    return t.chunks, t.optimizer, t.scheduler, model


def _microbatches(seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 8), generator=g)} for _ in range(2)]


def _megatron_step(chunks, opt, sched, mbs):
    """Megatron's own path: its finalize_model_grads (which divides the buffers) and optimizer.step()."""
    from megatron.core.distributed import finalize_model_grads

    for c in chunks:
        c.zero_grad_buffer()
        c.config.finalize_model_grads_func = finalize_model_grads
    opt.zero_grad()
    run_schedule(chunks, mbs, make_forward_step(_loss))
    ok, grad_norm, _ = opt.step()
    assert ok
    sched.step(increment=1)
    return grad_norm


@pytest.mark.parametrize("dtype,distributed_optimizer,clip_grad", [
    ("float32", False, 0.05),  # the norm is above 0.05: every step clips
    ("float32", False, 1e9),   # never clips: the division alone
    ("bfloat16", True, 0.05),
])
def test_weights_and_grad_norm_match_megatrons_step(world, dtype, distributed_optimizer, clip_grad):
    chunks, opt, sched, model = _trainable(dtype, distributed_optimizer, clip_grad)
    start = [p.detach().clone() for p in model.parameters()]
    *theirs, their_model = _trainable(dtype, distributed_optimizer, clip_grad, weights=model.state_dict())
    for step in range(3):
        stats = train_step(chunks, opt, sched, _microbatches(step), make_forward_step(_loss))
        grad_norm = _megatron_step(*theirs, _microbatches(step))
        assert stats["skipped"] == 0.0
        assert stats["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        if clip_grad < 1:
            assert grad_norm > clip_grad  # the case clips
    # bf16 weights: the same factor applied before Adam or inside it can round to the neighbouring bf16 value
    tol = 1e-6 if dtype == "float32" else 1e-2
    for a, b, a0 in zip(model.parameters(), their_model.parameters(), start):
        assert not torch.equal(a, a0)
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _moments(opt):
    return [v.detach().clone() for inner in getattr(opt, "chained_optimizers", [opt])
            for state in inner.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def test_a_nan_gradient_skips_the_step(world):
    chunks, opt, sched, model = _trainable("float32", False, 1.0, check_for_nan=False)  # as PPO wraps them
    train_step(chunks, opt, sched, _microbatches(0), make_forward_step(_loss))  # Adam has moments now
    before, moments = [p.detach().clone() for p in model.parameters()], _moments(opt)

    def poisoned(out, batch):
        loss, n, stats = _loss(out, batch)
        return loss * float("nan"), n, stats

    stats = train_step(chunks, opt, sched, _microbatches(1), make_forward_step(poisoned), skip_nonfinite=True)
    assert stats["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert moments and all(torch.equal(a, b) for a, b in zip(moments, _moments(opt)))  # step counts too
    stats = train_step(chunks, opt, sched, _microbatches(2), make_forward_step(_loss), skip_nonfinite=True)
    assert stats["skipped"] == 0.0 and not torch.equal(before[0], next(model.parameters()))
