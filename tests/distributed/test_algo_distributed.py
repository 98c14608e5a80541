"""algo statistics and vocab-parallel logprobs on 2 gloo ranks (torchrun)."""

from tests.distributed.launch import read_json, torchrun


def test_whitening_over_two_ranks_equals_concatenated_batch(tmp_path):
    out = tmp_path / "whiten.json"
    torchrun("algo_whiten.py", out, nproc=2)
    for rank, d in enumerate(read_json(out)):
        assert d["mean"] < 1e-12 and d["var"] < 1e-12, (rank, d)
        assert d["whiten"] < 1e-9, (rank, d)
        assert d["whiten_padding_nonzero"] == 0, (rank, d)
        assert d["grad"] < 1e-12, (rank, d)
        # The check has teeth: a rank's local variance is not the global one.
        assert d["local_var_differs"] > 1e-3, (rank, d)


def test_logprobs_and_entropy_tp2_equal_tp1(tmp_path):
    out = tmp_path / "logprobs.json"
    torchrun("algo_logprobs_tp.py", out, nproc=2)
    for rank, d in enumerate(read_json(out)):
        for case, diffs in d.items():
            for name, value in diffs.items():
                if name == "shard_width":
                    assert value == 31, (rank, case)  # 61 ids padded to 62, split in two
                else:
                    assert value < 1e-9, (rank, case, name, value)
