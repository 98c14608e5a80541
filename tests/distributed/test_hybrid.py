"""The hybrid engine on 2 gloo ranks (one script run, tests/distributed/scripts/hybrid_swap.py):
training TP=1xDP=2 -> generation TP=2, TP=2 -> TP=1, PP=2 -> TP=1 (into a generation model whose
cached plan came from the TP=2 source) and PP=2xVPP=2 -> TP=1. Each generates what a one-rank model
with the same weights generates, holds exactly the training weights, and training continues to the
bit after a swap."""

import pytest

from tests.distributed.launch import read_json, torchrun

PHASES = ("tp1_to_tp2", "tp2_to_tp1", "pp2_to_tp1", "vpp_to_tp1")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    torchrun("hybrid_swap.py", d / "out.json", d / "ckpt", timeout=600)
    return read_json(d / "out.json")  # one entry per rank


@pytest.mark.parametrize("phase", PHASES)
def test_generation_layout_matches_one_rank_model(results, phase):
    for rank, res in enumerate(results):
        got = res[phase]
        assert got["same"], (rank, phase, "generation weights differ from the training weights")
        lo, hi = got.get("rows", [0, 5])  # this rank's training share of the 5 prompts
        for case in ("greedy", "sample"):
            out, ref = got["out"][case], {k: v[lo:hi] for k, v in res["reference"][case].items()}
            for key in ("response_ids", "response_mask", "ended", "lengths"):
                assert out[key] == ref[key], (rank, phase, case, key)
            for row_out, row_ref in zip(out["logprobs"], ref["logprobs"]):
                assert row_out == pytest.approx(row_ref, abs=1e-5), (rank, phase, case)


def test_redistribution_no_duplicate_no_loss_and_identical_within_model_parallel_group(results):
    # Training DP=2 (phase tp1_to_tp2): the two shares are disjoint and cover the batch.
    shares = sorted(tuple(r["tp1_to_tp2"]["rows"]) for r in results)
    assert shares == [(0, 3), (3, 5)]
    # Training TP=2 / PP=2 (DP=1): both ranks of the model-parallel group hold the same rollouts.
    for phase in PHASES[1:]:
        assert results[0][phase]["out"] == results[1][phase]["out"], phase


def test_stale_plan_is_dropped_when_the_source_layout_changes(results):
    assert all(r["pp2_to_tp1"]["plan_rebuilt"] for r in results)


def test_training_continues_bit_identically_after_a_swap(results):
    for res in results:
        c = res["continue"]
        assert c["moved"], "the two optimizer steps changed nothing: the comparison would be vacuous"
        assert c["bit_identical"]
        assert c["same_after_step"] and c["plans_built"] == 1  # the plan is reused and still right


def test_reference_and_reward_at_inference_tp1_match_training_tp2(results):
    for res in results:
        for name in ("reference", "reward"):
            got = res["inference_tp1"][name]
            assert got["shape"] and got["spread"] > 0.01, (name, got)  # varied values, not a constant
            assert got["max_diff"] <= 1e-5, (name, got)
