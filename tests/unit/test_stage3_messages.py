"""Stage-3 inputs that used to be silently wrong or blamed on the wrong thing (issue 22): the reward
calibration is checked where it is loaded (item 7), a step without common.pt is named (item 14) and
ppo.beta=inf is refused as a setting. A world of one rank, in process."""

import pytest

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config import schema as C
from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.trainer.ppo.models import reward_calibration
from tests.unit.test_checkpoint_damage import _models


def _rm_checkpoint(root, calibration):
    ckpt.save_checkpoint(root, 2, {"reward": _models()["policy"]}, {}, {}, {"reward_calibration": calibration},
                         run=ckpt.RunRecord.new("rm"))
    return root


@pytest.mark.parametrize("calibration, said", [
    ({"mean": 0.3, "std": 0.0}, "has std=0.0: the reward model gives every sample the same score"),
    ({"mean": float("nan"), "std": 0.4}, "has mean=nan"),
    ({"mean": 0.3}, "has no std"),
    ({"mean": "x", "std": 1.0}, "has mean='x', not a number"),
])
def test_a_bad_reward_calibration_is_named_where_it_is_loaded(world, tmp_path, calibration, said):
    root = _rm_checkpoint(tmp_path / "rm", calibration)
    with pytest.raises(ckpt.CheckpointError) as e:
        reward_calibration(str(root))
    assert str(e.value).startswith(f"the reward calibration in {root / 'step_00000002' / 'common.pt'} {said}"), e.value
    assert "ppo.normalize_reward=false" in str(e.value)


def test_a_good_calibration_loads(world, tmp_path):
    assert reward_calibration(str(_rm_checkpoint(tmp_path / "rm", {"mean": 0.3, "std": 0.5}))) == {"mean": 0.3,
                                                                                                     "std": 0.5}


def test_a_step_without_common_pt_is_named(world, tmp_path):
    root = _rm_checkpoint(tmp_path / "rm", {"mean": 0.3, "std": 0.5})
    (root / "step_00000002" / "common.pt").unlink()
    with pytest.raises(ckpt.CheckpointError) as e:
        reward_calibration(str(root))
    assert "common.pt" in str(e.value) and "iterdir" not in str(e.value), e.value
    assert str(e.value).startswith(f"checkpoint {root / 'step_00000002'} is damaged (common.pt: missing)"), e.value


def test_beta_inf_is_refused_as_a_setting():
    from megatron_rlhf.config.ppo import validate_ppo

    cfg = C.PPOConfig()
    cfg.ppo.beta, cfg.ppo.reward_load, cfg.model.load = float("inf"), "rm", "sft"
    with pytest.raises(ConfigError, match=r"ppo.beta=inf must be a finite number >= 0"):
        validate_ppo(cfg)
