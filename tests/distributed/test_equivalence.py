"""TP=2 (with and without sequence parallelism), PP=2 (+ virtual pipeline) and DP=2 with the distributed optimizer match a single-rank run.

Same fixed batch, same initial weights (loaded from a checkpoint the single-rank run saved),
dropout off, fp32, gradient clipping active (clip 0.5 < the measured grad norms), 3 optimizer
steps of an LM and of a value model (scalar head).
"""

import pytest

from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.plan.params import Layout, stage_params
from tests.distributed.launch import read_json, torchrun

LAYOUTS = {
    # name: (tp, pp, distributed optimizer, vpp[, sequence parallel])
    "tp2": (2, 1, 0, 0),
    "tp2_sp": (2, 1, 0, 0, 1),  # the local spec's norms sum their weight gradients over TP (models/norm_glu.py)
    "pp2": (1, 2, 0, 0),
    "pp2_vpp2": (1, 2, 0, 2),
    "dp2_distopt": (1, 1, 1, 0),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("equivalence")
    torchrun("equivalence.py", d / "ref.json", d / "init", "save", 1, 1, 0, nproc=1)
    return d, read_json(d / "ref.json")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_rank(reference, layout):
    d, ref = reference
    tp, pp, distopt, vpp, *sp = LAYOUTS[layout]
    out = d / f"{layout}.json"
    torchrun("equivalence.py", out, d / "init", "load", tp, pp, distopt, vpp, *sp, nproc=2)
    got = read_json(out)
    for head in ("lm", "scalar"):
        assert len(got[head]) == 3
        for step, (a, b) in enumerate(zip(ref[head], got[head])):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (head, step)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-5), (head, step)
        # Clipping was active (the norm exceeded 0.5) and training moved the loss.
        assert max(s["grad_norm"] for s in ref[head]) > 0.5
        assert ref[head][2]["loss"] < ref[head][0]["loss"]
    # The planner's per-rank parameter counts are those of the real build of this layout.
    model = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=64, max_position_embeddings=64)
    for head in ("lm", "scalar"):
        for pp_rank, _tp_rank, count in got[f"params_{head}"]:
            assert count == stage_params(model, Layout(tp, pp, vpp or None), pp_rank, head), (head, pp_rank)
