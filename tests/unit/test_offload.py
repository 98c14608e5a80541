"""rollout/offload.py: gradient buffers and optimizer state to host memory and back during generation.
On CPU the default is a no-op; device_type="cpu" runs the real copy / free / restore path, and training
must continue bit-identically to a twin that never offloaded."""

import pytest
import torch

from megatron_rlhf.config.schema import TrainConfig
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.offload import PhaseMemory, offloaded, released, training_state_tensors
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.run import Trainable
from megatron_rlhf.trainer.step import make_forward_step, train_step

VOCAB = 32


def _trainable(dtype, distributed_optimizer, weights=None, clip_grad=1.0, check_for_nan=True):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, params_dtype=dtype, init_method_std=0.2)
    torch.manual_seed(0)
    (model,) = build_model(cfg, ParallelConfig())
    if weights is not None:
        model.load_state_dict(weights)
    chunks = wrap_ddp([model], distributed_optimizer, check_for_nan_in_grad=check_for_nan)
    opt, sched = build_optimizer(chunks, TrainConfig(lr=1e-2, clip_grad=clip_grad), distributed_optimizer, 10)
    return Trainable(chunks, opt, sched), model


def _loss(out, batch):
    n = torch.tensor(out.shape[0] * out.shape[1])
    loss = -torch.log_softmax(out.float(), -1)[..., 0].sum()
    return loss, n, {"loss": (loss.detach(), n)}


def _step(t, seed):
    mbs = [{"input_ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))}]
    return train_step(t.chunks, t.optimizer, t.scheduler, mbs, make_forward_step(_loss))


def _state(t, model):
    """Everything training reads, as clones: weights, gradient buffers, optimizer tensors."""
    return [p.detach().clone() for p in model.parameters()] + [x.detach().clone() for x in training_state_tensors(t)]


@pytest.mark.parametrize("dtype,distributed_optimizer", [("float32", False), ("bfloat16", True)])
def test_round_trip_frees_the_state_and_training_continues_bit_identically(world, dtype, distributed_optimizer):
    a, model_a = _trainable(dtype, distributed_optimizer)
    b, model_b = _trainable(dtype, distributed_optimizer, weights=model_a.state_dict())  # the twin
    _step(a, 1), _step(b, 1)
    before = _state(a, model_a)
    grads = [buf.grad_data for c in a.chunks for buf in c.buffers]

    with offloaded([a], device_type="cpu") as moves:
        assert moves.nbytes > 0
        assert all(g.untyped_storage().nbytes() == 0 for g in grads)  # gradient buffers freed
        state = [x for x in training_state_tensors(a) if x.dim() and x.numel() > 1]  # Adam moments etc.
        assert state and all(x.untyped_storage().nbytes() == 0 for x in state)
        assert all(p.untyped_storage().nbytes() > 0 for p in model_a.parameters())  # weights stay: generation
    after = _state(a, model_a)
    assert all(torch.equal(x, y) for x, y in zip(before, after))

    first, second = _step(a, 2), _step(b, 2)
    assert first["grad_norm"] > 0 and first == second
    assert all(torch.equal(x, y) for x, y in zip(_state(a, model_a), _state(b, model_b)))
    assert not all(torch.equal(x, y) for x, y in zip(before, _state(a, model_a)))  # the step moved something


@pytest.mark.parametrize("dtype,distributed_optimizer", [("float32", False), ("bfloat16", True)])
def test_released_weights_are_unusable_inside_and_training_continues_bit_identically(world, dtype, distributed_optimizer):
    """What a separate generation copy (hybrid layout, vLLM) allows: the training weights leave the device."""
    a, model_a = _trainable(dtype, distributed_optimizer)
    b, model_b = _trainable(dtype, distributed_optimizer, weights=model_a.state_dict())
    _step(a, 1), _step(b, 1)
    before = _state(a, model_a)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with offloaded([a], device_type="cpu"), released(a.chunks, device_type="cpu") as moves:
        assert moves.nbytes >= sum(p.numel() * p.element_size() for p in model_a.parameters())
        assert all(p.untyped_storage().nbytes() == 0 for p in model_a.parameters())
        with pytest.raises(RuntimeError):  # nothing can read them by mistake
            model_a(ids, torch.arange(4).unsqueeze(0), None)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(a, model_a)))
    first, second = _step(a, 2), _step(b, 2)
    assert first["grad_norm"] > 0 and first == second
    assert all(torch.equal(x, y) for x, y in zip(_state(a, model_a), _state(b, model_b)))


def test_on_cpu_the_default_moves_nothing(world):
    a, model = _trainable("float32", False)
    _step(a, 1)
    with offloaded([a, None]) as moves, released(a.chunks) as weights:  # None: a critic-free run has no value model
        assert moves.nbytes == weights.nbytes == 0
        assert all(x.untyped_storage().nbytes() > 0 for x in training_state_tensors(a) + list(model.parameters()))


class _Recorder:
    def __init__(self):
        self.logged = []

    def timer(self, name):
        import contextlib

        return contextlib.nullcontext()

    def log(self, step, scalars):
        self.logged.append(dict(scalars))


def test_phase_memory_logs_each_timed_phase_and_keeps_the_run_peak():
    metrics = PhaseMemory(_Recorder())
    with metrics.timer("time/iteration"):
        with metrics.timer("time/rollout"):
            pass
        with metrics.timer("time/train"):
            pass
    metrics.log(1, {"perf/peak_memory_gib": 0.0})
    (logged,) = metrics._metrics.logged
    assert set(logged) == {"perf/peak_memory_gib", *(f"perf/peak_memory_gib/{p}" for p in ("iteration", "rollout", "train"))}
    assert logged["perf/peak_memory_gib"] >= logged["perf/peak_memory_gib/iteration"] >= logged["perf/peak_memory_gib/rollout"] > 0
    metrics.log(2, {})
    assert metrics._metrics.logged[-1] == {}  # logged once, not again
