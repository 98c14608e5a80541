"""models/packing.py through `step.model_forward`: a micro-batch's rows packed end to end give the padded
forward's outputs (LM logits, logits at chosen rows, scalar scores, Megatron's per-token loss) and gradients within
1e-6; no packed sequence reads another (changing one leaves the others bit-identical); the packed rotary positions
restart per sequence exactly as Megatron's own THD rotation does; and the pack's layout (widths, boundaries,
unpacking) is what the schedule needs."""

import pytest
import torch

from megatron_rlhf.models import packing
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.step import model_forward, pack_widths

VOCAB = 67
LENGTHS = [5, 13, 2, 9]


def _model(head="lm", groups=2):
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                      vocab_size=VOCAB, max_position_embeddings=64)
    torch.manual_seed(0)
    (model,) = build_model(cfg, ParallelConfig(), head=head)
    if head == "scalar":  # a fresh head is zero: no gradient would reach the body
        torch.nn.init.normal_(model.output_layer.weight)
    return model


def _batch(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), s), generator=g)
    lengths = torch.tensor(lengths)
    real = torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)
    return {"input_ids": ids.masked_fill(~real, 0), "lengths": lengths}, real


@pytest.fixture
def packed():
    packing.configure(True)
    yield
    packing.configure(False)


def _run(model, batch, on, rows=None, **extra):
    packing.configure(on)
    try:
        [mb] = pack_widths([batch], pipelined=False)
        return model_forward(model, mb, rows, **extra)
    finally:
        packing.configure(False)


@pytest.mark.parametrize("head, groups", [("lm", 2), ("lm", 4), ("scalar", 2)])
def test_packed_outputs_and_gradients_equal_padded(world, head, groups):
    model = _model(head, groups)
    batch, real = _batch()
    outs, grads = [], []
    for on in (False, True):
        model.zero_grad()
        out = _run(model, batch, on)
        assert out.shape[:2] == real.shape
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) * real.unsqueeze(-1)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert (outs[1] - outs[0])[real].abs().max() <= 1e-6
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        assert (grads[1][name] - g).abs().max() <= 1e-6 * g.abs().max(), name


def test_the_real_token_fraction_counts_what_each_forward_ran(world):
    """perf/real_token_fraction: 29 real tokens of a 4 x 13 padded batch (0.56), all of them packed."""
    model, (batch, _) = _model(), _batch()
    packing.take_real_token_fraction()  # whatever earlier tests ran
    assert packing.take_real_token_fraction() is None  # nothing ran since the last call
    with torch.no_grad():
        _run(model, batch, False)
        assert packing.take_real_token_fraction() == sum(LENGTHS) / (len(LENGTHS) * max(LENGTHS))
        _run(model, batch, True)
        _run(model, batch, True)
    assert packing.take_real_token_fraction() == 1.0


def test_packed_logits_at_rows_and_the_labels_loss_equal_padded(world):
    model = _model()
    batch, real = _batch()
    rows = torch.tensor([[1, 2, 3, 4], [8, 9, 10, 11], [0, 1, 1, 1], [5, 6, 7, 8]])
    padded, packed_ = (_run(model, batch, on, rows) for on in (False, True))
    assert packed_.shape == (4, 4, VOCAB)
    ok = rows < torch.tensor(LENGTHS).unsqueeze(1)
    assert (packed_ - padded)[ok].abs().max() <= 1e-6
    labels = torch.roll(batch["input_ids"], -1, 1)
    loss_padded, loss_packed = (_run(model, batch, on, labels=labels) for on in (False, True))
    assert loss_packed.shape == real.shape
    inside = real & (torch.arange(real.shape[1]) < torch.tensor(LENGTHS).unsqueeze(1) - 1)
    assert (loss_packed - loss_padded)[inside].abs().max() <= 1e-6


def test_no_packed_sequence_reads_another(world, packed):
    """The leak test (the symptom of attention across packed sequences is only a small drift): new tokens in
    sequence 1 change its outputs and leave every other sequence's bit for bit."""
    model = _model()
    batch, real = _batch()
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][1, : LENGTHS[1]] = torch.randint(1, VOCAB, (LENGTHS[1],), generator=torch.Generator().manual_seed(9))
    [a, b] = [model_forward(model, mb) for mb in pack_widths([batch, changed], pipelined=False)]
    for i, n in enumerate(LENGTHS):
        if i == 1:
            assert not torch.equal(a[i, :n], b[i, :n])
        else:
            assert torch.equal(a[i, :n], b[i, :n]), i


def test_packed_rotation_equals_megatrons_thd_rotation(world):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rlhf.models import rope

    rope.install()
    p = packing.pack(*_batch().__getitem__(0).values(), multiple=8)
    t = torch.randn(p.width, 3, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    f = torch.outer(torch.arange(p.params.max_seqlen_q).float(), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    ours = rope_utils._apply_rotary_pos_emb_thd(t, p.params.cu_seqlens_q, freqs, cp_group=_one_rank_group())
    theirs = rope_utils._apply_rotary_pos_emb_thd.megatron(t, p.params.cu_seqlens_q, freqs, cp_group=_one_rank_group())
    assert torch.equal(ours, theirs)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(6))
    (ga,) = torch.autograd.grad(ours, t, g)
    (gb,) = torch.autograd.grad(theirs, t, g)
    assert torch.allclose(ga, gb, atol=1e-6)


def _one_rank_group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def test_the_pack_layout():
    batch, _ = _batch([3, 1, 4])
    p = packing.pack(batch["input_ids"], batch["lengths"], multiple=4)
    assert p.width == 8 and p.params.segments == [3, 1, 4]  # 8 tokens: no tail padding needed
    assert p.input_ids[0].tolist() == batch["input_ids"][0, :3].tolist() + batch["input_ids"][1, :1].tolist() \
        + batch["input_ids"][2, :4].tolist()
    assert p.position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert p.params.cu_seqlens_q.tolist() == [0, 3, 4, 8] and p.params.max_seqlen_q == 4
    q = packing.pack(batch["input_ids"], batch["lengths"], width=11)
    assert q.params.segments == [3, 1, 4, 3] and q.input_ids[0, 8:].tolist() == [0, 0, 0]  # the tail: its own
    out = torch.arange(11.0).view(1, 11, 1)
    assert packing.unpack(out, q, 4)[..., 0].tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    assert packing.pack_rows(torch.tensor([[0, 2], [0, 1], [1, 3]]), q).tolist() == [[0, 2, 3, 3, 5, 7]]
    with pytest.raises(ValueError, match="width 7 cannot hold 8 tokens"):
        packing.pack(batch["input_ids"], batch["lengths"], width=7)


def test_pack_widths_round_to_the_layout_and_one_width_through_a_pipeline():
    a, _ = _batch([3, 4])
    b, _ = _batch([9, 2, 2])
    assert pack_widths([a, b], pipelined=False) == [a, b]  # packing off: as they are
    packing.configure(True, sequence_multiple=4, min_saving=0.0)
    try:
        assert [mb["pack_width"] for mb in pack_widths([a, b], pipelined=False)] == [8, 16]
        assert [mb["pack_width"] for mb in pack_widths([a, b], pipelined=True)] == [16, 16]
        assert "pack_width" not in pack_widths([{"input_ids": a["input_ids"]}], pipelined=False)[0]  # no lengths
        packing.configure(True, min_saving=0.1)
        # 35 tokens of 36 padded: too little padding to be worth a pack; 40 of 48 (17% padding) is.
        assert "pack_width" not in pack_widths([_batch([9, 9, 9, 8])[0]], pipelined=False)[0]
        assert pack_widths([_batch([12, 12, 12, 4])[0]], pipelined=False)[0]["pack_width"] == 40
        # Through a pipeline, micro-batches of unequal row counts (token budgets) cannot run padded: one
        # activation shape for all, so they pack even with little padding.
        full, short = _batch([9, 9, 9, 8])[0], _batch([9])[0]
        assert "pack_width" not in pack_widths([full, short], pipelined=False)[0]
        assert [mb["pack_width"] for mb in pack_widths([full, short], pipelined=True)] == [35, 35]
    finally:
        packing.configure(False)
