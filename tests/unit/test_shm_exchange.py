"""rollout/shm_exchange.py's choice of transport, in a world of one: the shared-memory segment when /dev/shm
has room, gloo P2P (no segment, weights left where they were) when it lacks room or the caller asks for it.
Either way the swap writes every element of a generation copy built without drawing its weights. (The 2-rank
paths run in tests/distributed/test_hybrid.py.)"""

import pytest
import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout import shm_exchange
from megatron_rlhf.rollout.hybrid import WeightSwap
from megatron_rlhf.rollout.layout import build_in_layout, tp_only_layout

CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=64, max_position_embeddings=32, init_method_std=0.2)


def _swap(monkeypatch, room: bool, transport: str = "auto"):
    monkeypatch.setattr(shm_exchange, "_room_for", lambda nbytes: room)
    torch.manual_seed(0)
    chunks = build_model(CFG, ParallelConfig())
    target = build_in_layout(CFG, 1, tp_only_layout(1), initialise=False)  # as the hybrid engine builds it
    for p in target.parameters():
        p.data.fill_(float("nan"))  # an element the swap left unwritten stays unequal
    storages = {n: p.untyped_storage().data_ptr() for n, p in target.named_parameters()}
    swap = WeightSwap(chunks, target, transport=transport)
    swap()
    assert all(torch.equal(p, q) for p, q in zip(chunks[0].parameters(), target.parameters()))
    moved = any(p.untyped_storage().data_ptr() != storages[n] for n, p in target.named_parameters())
    return swap, moved


def test_shared_memory_when_there_is_room(world, monkeypatch):
    swap, moved = _swap(monkeypatch, room=True)
    assert swap.exchange is not None and moved  # the generation weights now live in the segment


@pytest.mark.parametrize("room,transport", [(False, "auto"), (True, "gloo")])
def test_gloo_when_dev_shm_lacks_room_or_when_asked(world, monkeypatch, room, transport):
    swap, moved = _swap(monkeypatch, room=room, transport=transport)
    assert swap.exchange is None and not moved


def test_unknown_transport_is_refused(world):
    with pytest.raises(ValueError, match="transport='nccl'"):
        WeightSwap(build_model(CFG, ParallelConfig()), build_in_layout(CFG, 1, tp_only_layout(1)), transport="nccl")
