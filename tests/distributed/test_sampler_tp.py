"""The megatron sampler at TP=2 (2 gloo ranks) against TP=1 with the same weights, through the lean
decode forward (the default) and through Megatron's own forward (path="module")."""

import torch

from tests.distributed.launch import read_json, torchrun

VOCAB = 61


def test_tp2_generates_the_same_tokens_as_tp1(tmp_path):
    out = tmp_path / "sampler.json"
    torchrun("sampler_tp.py", out, tmp_path / "ckpt", nproc=2)
    ranks = read_json(out)
    ref = ranks[0]["tp1"]
    for rank, d in enumerate(ranks):
        # The lean forward ran at both sizes, and its logits are Megatron's at every step.
        assert d["path"] == {"tp1": "lean", "tp2": "lean"}, (rank, d["path"])
        assert max(d["lean_gap"].values()) <= 1e-5, (rank, d["lean_gap"])
        for case, r1 in ref.items():
            for which in ("tp1", "tp2", "tp2_module"):
                r = d[which][case]
                # Same tokens, masks and EOS flags at both TP sizes and on both ranks.
                for key in ("response_ids", "response_mask", "ended", "lengths"):
                    assert r[key] == r1[key], (rank, which, case, key)
                diff = (torch.tensor(r["logprobs"]) - torch.tensor(r1["logprobs"])).abs().max().item()
                assert diff < 1e-5, (rank, which, case, diff)
            ids = torch.tensor(r1["response_ids"])
            assert ids.max() < VOCAB, case  # the padded id (61) is never sampled
    # The check has teeth: the cases differ from each other, and some rows end with EOS, some do not.
    assert ref["greedy"]["response_ids"] != ref["sample_t1"]["response_ids"]
    assert ref["sample_t1"]["response_ids"] != ref["sample_t07"]["response_ids"]
    ended = [e for case in ref.values() for e in case["ended"]]
    assert any(ended) and not all(ended)
