"""Tiny trainables for the checkpoint tests: a model with its distributed optimizer, stepped on random tokens."""

import torch

from megatron_rlhf.config.schema import TrainConfig
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.run import Trainable
from megatron_rlhf.trainer.step import make_forward_step, train_step

VOCAB = 32


def tiny_trainable(dtype: str, seed: int, distributed: bool = True):
    """A 2-layer GPT with the distributed optimizer (or the plain one; one rank): (Trainable, the unwrapped
    model)."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, params_dtype=dtype, init_method_std=0.2)
    torch.manual_seed(seed)
    (model,) = build_model(cfg, ParallelConfig())
    chunks = wrap_ddp([model], distributed)
    optimizer, scheduler = build_optimizer(chunks, TrainConfig(lr=1e-2), distributed, 10)
    return Trainable(chunks, optimizer, scheduler), model


def train_once(t: Trainable, seed: int) -> None:
    """One optimizer step on a [2, 8] batch drawn from `seed`."""
    def loss(out, batch):
        n = torch.tensor(out.shape[0] * out.shape[1])
        total = -torch.log_softmax(out.float(), -1)[..., 0].sum()
        return total, n, {"loss": (total.detach(), n)}

    mbs = [{"input_ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))}]
    train_step(t.chunks, t.optimizer, t.scheduler, mbs, make_forward_step(loss))


def checkpoint_objects(**trainables: Trainable) -> tuple:
    """(models, optimizers, schedulers) by name, as save_checkpoint and load_checkpoint take them."""
    return ({n: t.chunks for n, t in trainables.items()}, {n: t.optimizer for n, t in trainables.items()},
            {n: t.scheduler for n, t in trainables.items()})
