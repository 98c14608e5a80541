"""checkpoint/state.py: the distributed optimizer's state on disk. Saves write each rank's own shard (Megatron's
"dp_reshardable": nothing gathered into host memory); a load reads the format the checkpoint records, the
"fully_reshardable" of earlier checkpoints included. Either way the resumed optimizer continues exactly as the
one that saved, torch Adam's per-parameter `step` included. A world of one rank, in process."""

import pytest
import torch

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config.schema import TrainConfig
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.run import Trainable
from megatron_rlhf.trainer.step import make_forward_step, train_step

VOCAB = 32


def _trainable(dtype: str, seed: int):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, params_dtype=dtype, init_method_std=0.2)
    torch.manual_seed(seed)
    (model,) = build_model(cfg, ParallelConfig())
    chunks = wrap_ddp([model], True)
    optimizer, scheduler = build_optimizer(chunks, TrainConfig(lr=1e-2), True, 10)
    return Trainable(chunks, optimizer, scheduler), model


def _step(t: Trainable, seed: int) -> None:
    def loss(out, batch):
        n = torch.tensor(out.shape[0] * out.shape[1])
        total = -torch.log_softmax(out.float(), -1)[..., 0].sum()
        return total, n, {"loss": (total.detach(), n)}

    mbs = [{"input_ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))}]
    train_step(t.chunks, t.optimizer, t.scheduler, mbs, make_forward_step(loss))


def _objects(**trainables: Trainable) -> tuple:
    return ({n: t.chunks for n, t in trainables.items()}, {n: t.optimizer for n, t in trainables.items()},
            {n: t.scheduler for n, t in trainables.items()})


def _written_as_earlier(layout: dict):
    """`_sharded_state` as checkpoints written before the layout was recorded: that layout, no record."""
    original = ckpt._sharded_state

    def sharded_state(*args, **kwargs):
        state = original(*args, **{**kwargs, "optimizer_layout": layout})
        del state["optimizer_layout"]
        return state
    return sharded_state


# What saves write, and the two layouts of earlier checkpoints (which record none): the distributed optimizer's
# shards under Megatron's keys, and the whole state gathered ("fully_reshardable").
LAYOUTS = {"current": None, "earlier_shards": {"format": "dp_reshardable", "keys": "shared"},
           "earlier_gathered": {"format": "fully_reshardable", "keys": "shared"}}


@pytest.mark.parametrize("written", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_resumed_distributed_optimizer_continues_exactly(world, tmp_path, monkeypatch, written, dtype):
    saver, saved_model = _trainable(dtype, seed=0)
    for s in (0, 1):
        _step(saver, s)
    with monkeypatch.context() as m:
        if LAYOUTS[written] is not None:
            m.setattr(ckpt, "_sharded_state", _written_as_earlier(LAYOUTS[written]))
        step_dir = ckpt.save_checkpoint(tmp_path, 2, *_objects(policy=saver), {})
    assert ckpt._saved_optimizer_layout(step_dir) == (LAYOUTS[written] or ckpt.optim_state.LAYOUT)
    resumed, resumed_model = _trainable(dtype, seed=1)  # other weights, a fresh optimizer
    ckpt.load_checkpoint(step_dir, *_objects(policy=resumed))
    for s in (2, 3):  # Adam's moments and per-parameter step decide these two updates
        _step(saver, s)
        _step(resumed, s)
    assert all(torch.equal(p, q) for p, q in zip(saved_model.parameters(), resumed_model.parameters()))


def test_two_distributed_optimizers_share_a_checkpoint(world, tmp_path):
    """PPO's policy and value in one checkpoint, each with its distributed optimizer: Megatron keys both
    optimizers' shards alike, so without the model's name in front of its optimizer's keys the save failed
    its sharding validation ("Duplicate ShardedObject keys"; on 2 ranks, rank 0 alone, and the others hung)."""
    policy, policy_model = _trainable("float32", seed=0)
    value, value_model = _trainable("float32", seed=1)
    for s in (0, 1):
        _step(policy, s)
        _step(value, 10 + s)
    step_dir = ckpt.save_checkpoint(tmp_path, 2, *_objects(policy=policy, value=value), {})
    policy2, policy2_model = _trainable("float32", seed=2)
    value2, value2_model = _trainable("float32", seed=3)
    ckpt.load_checkpoint(step_dir, *_objects(policy=policy2, value=value2))
    for s in (2, 3):
        for t, seed in ((policy, s), (policy2, s), (value, 10 + s), (value2, 10 + s)):
            _step(t, seed)
    for a, b in ((policy_model, policy2_model), (value_model, value2_model)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_dropped_distributed_optimizer_and_its_model_are_freed(world):
    """The model config's `grad_scale_func` reaches the optimizer weakly (trainer/optim.py `_weak_method`): held
    strongly, it closed a cycle through tensors that autograd's C++ side also holds, the garbage collector never
    freed the pair, and the process groups they hold kept their gloo threads to interpreter shutdown."""
    import gc
    import weakref

    t, model = _trainable("float32", seed=0)
    _step(t, 0)
    refs = [weakref.ref(x) for x in (t.chunks[0], t.optimizer, model)]
    del t, model
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
