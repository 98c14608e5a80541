"""parallel/grad_buffer.py: DDP's gradient buffers of bf16 weights marked unwritten instead of zeroed, and
overwritten by each step's first write (DDP's hook, the embedding lookup), give the gradients that zeroed
buffers give, over two microbatches, whatever the buffers held before; a gradient that no write reaches is
zeroed by `settle`; buffers of fp32 weights (the fused GEMMs accumulate into them) are zeroed as before."""

import pytest
import torch

from megatron_rlhf.parallel import grad_buffer
from tests.unit.test_grad_accumulation import VOCAB, _wrapped


def _backward(chunk, microbatches=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(microbatches):
        ids = torch.randint(0, VOCAB, (3, 7), generator=g)
        pos = torch.arange(7).unsqueeze(0).expand(3, 7)
        logits = chunk(ids, pos, attention_mask=None)
        (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()


def _poison(chunk):
    """Every parameter's gradient NaN (the padding between them stays as DDP left it: zero)."""
    for p in chunk.module.parameters():
        p.main_grad.fill_(float("nan"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # fused GEMMs into zeroed buffers (fp32), DDP's hook (bf16)
def test_first_writes_give_the_gradients_of_zeroed_buffers(world, dtype):
    (lazy, linears, _), (eager, *_) = _wrapped(dtype), _wrapped(dtype)
    assert all(m.gradient_accumulation_fusion for m in linears) == (dtype == "float32")
    eager.zero_grad_buffer()
    _backward(eager)
    _poison(lazy)
    grad_buffer.zero_grads([lazy])
    marked = [getattr(p.main_grad, "unwritten", False) for p in lazy.module.parameters()]
    assert all(marked) if dtype == "bfloat16" else not any(marked)
    if dtype == "float32":
        assert all(torch.equal(b.grad_data, torch.zeros_like(b.grad_data)) for b in lazy.buffers)
    assert all("reset" not in vars(b) for b in lazy.buffers)  # Megatron's own reset is back in place
    _backward(lazy)
    grad_buffer.settle([lazy])
    theirs = dict(eager.module.named_parameters())
    for name, p in lazy.module.named_parameters():
        assert not getattr(p.main_grad, "unwritten", False), name
        assert p.main_grad.abs().sum() > 0, name
        assert torch.equal(p.main_grad, theirs[name].main_grad), name
    assert all(torch.isfinite(b.grad_data).all() for b in lazy.buffers)


def test_a_gradient_no_write_reaches_is_zeroed(world):
    chunk, _, embedding = _wrapped("bfloat16")
    _poison(chunk)
    grad_buffer.zero_grads([chunk])
    grad_buffer.settle([chunk])  # a step whose loss reached no parameter
    assert all(torch.equal(b.grad_data, torch.zeros_like(b.grad_data)) for b in chunk.buffers)
    _poison(chunk)
    grad_buffer.zero_grads([chunk])
    with torch.no_grad():
        embedding.main_grad.copy_(torch.ones_like(embedding.main_grad))  # a write the flag did not see
    grad_buffer.settle([chunk])
    assert torch.equal(embedding.main_grad, torch.zeros_like(embedding.main_grad))  # unwritten, so zeroed


def test_the_step_reads_settled_buffers(world):
    """train_step marks the buffers, and finalize_grads settles them before the data-parallel reduction, the NaN
    check and the optimizer: poisoned gradients from before the step never reach the weights."""
    from megatron_rlhf.trainer.step import make_forward_step, train_step
    from tests.unit.test_optimizer_step import _microbatches, _trainable
    from tests.unit.test_offload import _loss

    chunks, opt, sched, model = _trainable("bfloat16", False, 1e9)
    *theirs, their_model = _trainable("bfloat16", False, 1e9, weights=model.state_dict())
    for chunk in chunks:
        _poison(chunk)
    stats = train_step(chunks, opt, sched, _microbatches(0), make_forward_step(_loss))
    their_stats = train_step(*theirs, _microbatches(0), make_forward_step(_loss))
    assert stats["skipped"] == 0.0 and stats["grad_norm"] == their_stats["grad_norm"]
    for a, b in zip(model.parameters(), their_model.parameters()):
        assert torch.equal(a, b)
