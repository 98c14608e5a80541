"""Packed micro-batches (models/packing.py) against padded ones in the trainer's PPO passes, on 2 ranks at TP=2
and PP=2: old log-probs, values, reward scores, the policy and value losses and every gradient agree within 1e-6
(relative to each quantity's scale), and no packed sequence reads another. Sequence parallelism needs Transformer
Engine (parallel/layout.py refuses it on the local spec), so its packs (widths rounded to the TP size) are
checked in tests/unit/test_packing.py and run on GPU only."""

import pytest

from tests.distributed.launch import read_json, torchrun


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_packed_passes_equal_padded_and_do_not_leak(tmp_path, tp, pp):
    out = tmp_path / "packing.json"
    torchrun("packing.py", out, tp, pp, 0)
    r = read_json(out)
    assert r["padding_fraction"] > 0.5  # most of the padded batch is padding: the comparison covers it
    for key in ("logprobs", "values", "scores", "policy_loss", "value_loss", "policy_grad_rel", "value_grad_rel"):
        assert r[key] <= 1e-6, (key, r[key])
    assert r["policy_grad_nonzero"] and r["value_grad_nonzero"]
    assert r["leak_others_equal"] and r["leak_changed_differs"]
