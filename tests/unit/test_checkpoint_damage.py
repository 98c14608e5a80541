"""Damaged checkpoints and checkpoints of another model: one CheckpointError line naming the
checkpoint and the way on (an older step, or resume=never), never a raw CheckpointException
(a BaseException) or a per-rank traceback. A world of one rank, in process."""

import os
import shutil

import pytest

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig

CFG = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
           vocab_size=17, max_position_embeddings=32)


def _models(**overrides):
    return {"policy": build_model(ModelConfig(**{**CFG, **overrides}), ParallelConfig())}


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """A checkpoint root with step 2 and step 4 (latest)."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    models = _models()
    for step in (2, 4):
        ckpt.save_checkpoint(root, step, models, {}, {}, {"step": step}, keep_last=3)
    return root


def _damaged_copy(saved, tmp_path, damage):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    damage(root / "step_00000004")
    return root


def _resume(root, **overrides):
    path = ckpt.latest_checkpoint(root)
    return ckpt.load_checkpoint(path, _models(**overrides), {}, {})


def _truncate(name, size):
    return lambda d: os.truncate(d / name, size)


@pytest.mark.parametrize("damage, cause", [
    (_truncate("__0_0.distcp", 100), "EOFError: truncated or corrupt file"),
    (_truncate("rng/rank00000.pt", 10), "rng/rank00000.pt: RuntimeError: truncated or corrupt file"),
    (_truncate("metadata.json", 0), "metadata.json: JSONDecodeError"),
    (_truncate(".metadata", 50), ".metadata: UnpicklingError: truncated or corrupt file"),
    (lambda d: sorted(d.glob("__*.distcp"))[-1].unlink(), "FileNotFoundError"),  # 0.16 writes two, 0.19 one
])
def test_damaged_checkpoint_names_itself_and_the_older_one(saved, tmp_path, damage, cause):
    root = _damaged_copy(saved, tmp_path, damage)
    with pytest.raises(ckpt.CheckpointError) as e:
        _resume(root)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"checkpoint {root / 'step_00000004'} is damaged (") and cause in msg, msg
    assert f"writing its name (step_00000002) into {root / 'latest'}" in msg and "checkpoint.resume=never" in msg
    (root / "latest").write_text("step_00000002\n")  # the remedy the message gives works
    assert _resume(root)["step"] == 2


def test_checkpoint_of_another_architecture_says_so(saved):
    with pytest.raises(ckpt.CheckpointError, match="does not fit this model .*Global shape mismatch") as e:
        _resume(saved, hidden_size=64, ffn_hidden_size=128)
    assert "model_config.json" in str(e.value) and "\n" not in str(e.value)


def test_model_load_from_a_damaged_checkpoint_points_at_an_older_step(saved, tmp_path):
    root = _damaged_copy(saved, tmp_path, _truncate("__0_0.distcp", 100))
    with pytest.raises(ckpt.CheckpointError, match=r"^model.load: checkpoint .*step_00000004 is damaged .*"
                                                   r"point model.load at an older one .*step_00000002"):
        ckpt.load_model_weights(root, _models()["policy"], "policy", "lm")
