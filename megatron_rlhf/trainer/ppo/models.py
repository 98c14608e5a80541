"""The four PPO models and the reward normalisation, built in the training layout.

    policy     trained  (DDP + optimizer)  from model.load (the SFT checkpoint)
    value      trained  (DDP + optimizer)  from ppo.value_load (a reward model, or a PPO checkpoint's value
                                           model; default: the RM), its head or a fresh one;
                                           not built at all by the critic-free estimators (grpo, rloo, remax)
    reference  frozen   (no DDP, no grad)  from ppo.reference_load (default: model.load); with
                                           ppo.reference_mode=swap, host copies of the policy's initial
                                           weights swapped into it (reference_swap.py)
    reward     frozen   (no DDP, no grad)  from ppo.reward_load; its checkpoint's reward_calibration

Frozen models get `requires_grad=False` and, on GPU with `ppo.offload_frozen`, live in host memory
between uses (`resident`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Union

import torch

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config.ppo import critic_free, reference_source
from megatron_rlhf.parallel import megatron_version
from megatron_rlhf.parallel.device import compute_device
from megatron_rlhf.trainer.ppo.reference_swap import HostReference
from megatron_rlhf.trainer.run import RunContext, Trainable, build_frozen, build_trainable, expected_tokenizer, with_lr


@dataclass
class PPOModels:
    policy: Trainable
    value: Optional[Trainable]  # None: a critic-free estimator (no weights, grads or optimizer state exist)
    reference: Union[List[torch.nn.Module], HostReference]
    reward: List[torch.nn.Module]
    reward_mean: float
    reward_std: float
    offload_frozen: bool = False
    reward_arch: Optional[object] = None  # the reward model's ModelConfig (its own, config/stage_models.py)

    @contextlib.contextmanager
    def frozen_on_device(self) -> Iterator[None]:
        """Reference and reward model on the GPU for the block (they stay in host memory otherwise
        with `ppo.offload_frozen`; a no-op on CPU or without it)."""
        with resident(self.reference, self.offload_frozen), resident(self.reward, self.offload_frozen):
            yield

    def forward_models(self) -> Dict[str, list]:
        """Name -> chunks, as `experience.score_and_recompute` takes them."""
        out = {"policy": self.policy.chunks, "reference": self.reference, "reward": self.reward}
        if self.value is not None:
            out["value"] = self.value.chunks
        return out

    def trainables(self) -> Dict[str, Trainable]:
        """The trained models by name (what checkpoints hold): policy, and value unless critic-free."""
        return {"policy": self.policy, **({"value": self.value} if self.value is not None else {})}


def reward_calibration(path: str) -> Dict[str, float]:
    """`reward_calibration` ({mean, std, ...}) stored in an RM checkpoint by stage 2's calibration pass."""
    from megatron.core import dist_checkpointing

    step_dir = ckpt.resolve_checkpoint_dir(path)
    try:
        common = dist_checkpointing.load_common_state_dict(str(step_dir))
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise ckpt.CheckpointError(f"cannot read the reward model checkpoint {step_dir}: {e}") from e
    extra = common.get("extra", {}) if isinstance(common, dict) else {}
    calibration = extra.get("reward_calibration")
    if not calibration:
        raise ckpt.CheckpointError(
            f"reward model checkpoint {step_dir} has no reward_calibration: run stage 2 with calibration.enabled=true, "
            "or set ppo.normalize_reward=false")
    check_calibration(calibration, step_dir / "common.pt" if megatron_version.common_state_file() else step_dir)
    return calibration


def check_calibration(calibration, where) -> None:
    """mean finite and std finite and > 0: a std of 0 would multiply every reward by 1e6, a NaN mean diverge."""
    def bad(why: str):
        return ckpt.CheckpointError(
            f"the reward calibration in {where} {why}: recalibrate the reward model (stage 2 with "
            "calibration.enabled=true), or set ppo.normalize_reward=false")

    if not isinstance(calibration, dict):
        raise bad(f"is a {type(calibration).__name__}, not {{mean, std}}")
    for key in ("mean", "std"):
        v = calibration.get(key)
        if v is None:
            raise bad(f"has no {key}")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise bad(f"has {key}={calibration[key]!r}, not a number") from None
        if not math.isfinite(v):
            raise bad(f"has {key}={v}")
    if float(calibration["std"]) <= 0:
        raise bad(f"has std={calibration['std']}: the reward model gives every sample the same score")


def build_ppo_models(cfg, ctx: RunContext, total_steps: int, reward_tokenizer=None) -> PPOModels:
    """Build and initialise the four models, three for the critic-free estimators (collective). Reward, value and
    reference each have their checkpoint's own architecture (config/stage_models.py); the reward model's checkpoint
    must have been trained with `reward_tokenizer` (ppo.reward_tokenizer) when given, else the policy's."""
    from megatron_rlhf.config.stage_models import other_models

    p = cfg.ppo
    arch = {m.name: m.arch for m in other_models(cfg)}
    torch.manual_seed(cfg.train.seed)
    policy = build_trainable(cfg, ctx, "lm", cfg.model.load, "policy", total_steps, check_for_nan_in_grad=False)
    # ppo.reference_mode=swap: the reference is the policy as loaded (both from model.load), kept in host memory
    swapped = HostReference(policy.chunks) if p.reference_mode == "swap" else None
    value = None
    if not critic_free(p):
        source = ("value", "reward") if p.value_load else "reward"  # a PPO run's critic, or a reward model
        value = build_trainable(cfg, ctx, "scalar", p.value_load or p.reward_load, source, total_steps,
                                train_cfg=with_lr(cfg.train, p.value_lr), skip_head=p.value_head == "fresh",
                                check_for_nan_in_grad=False, key="ppo.value_load" if p.value_load else "ppo.reward_load",
                                model_cfg=arch["value"])
    # Frozen models: the training layout, or their own inference layout (TP = ppo.inference_tp /
    # ppo.reward_inference_tp, PP = 1; trainer/ppo/inference_layout.py), each model by itself.
    from megatron_rlhf.config.stage_models import reward_inference_tp
    from megatron_rlhf.trainer.ppo.inference_layout import InferenceLayouts

    layouts = InferenceLayouts(cfg)
    load, key = reference_source(cfg)
    if swapped is not None:
        reference = swapped
    elif p.inference_tp is None:
        reference = freeze(build_frozen(cfg, ctx, "lm", load, "policy", key=key, model_cfg=arch["reference"]))
    else:
        reference = layouts.build(p.inference_tp, arch["reference"], "lm", load, "policy",
                                  tokenizer=expected_tokenizer(cfg, ctx.tokenizer), key=key)
    reward_tp = reward_inference_tp(p)
    named_by = "tokenizer.path" if reward_tokenizer is None else "ppo.reward_tokenizer"
    if reward_tp is None:
        reward = freeze(build_frozen(cfg, ctx, "scalar", p.reward_load, "reward", model_cfg=arch["reward"],
                                     tokenizer=reward_tokenizer, tokenizer_setting=named_by))
    else:
        reward = layouts.build(reward_tp, arch["reward"], "scalar", p.reward_load, "reward",
                               tokenizer=expected_tokenizer(cfg, reward_tokenizer or ctx.tokenizer, named_by))
    mean, std = 0.0, 1.0
    if p.normalize_reward:
        cal = reward_calibration(p.reward_load)
        mean, std = float(cal["mean"]), float(cal["std"])
        if ctx.log:
            ctx.log(f"reward normalisation from {p.reward_load}: (score - {mean:.4f}) / {std:.4f}")
    offload_now(reference, p.offload_frozen)
    offload_now(reward, p.offload_frozen)
    return PPOModels(policy, value, reference, reward, mean, std, p.offload_frozen, arch["reward"])


def freeze(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    for c in chunks:
        c.eval()
        for param in c.parameters():
            param.requires_grad_(False)
    return chunks


@contextlib.contextmanager
def resident(chunks: List[torch.nn.Module], offload: bool) -> Iterator[None]:
    """Keep a frozen model on the GPU only inside the block (`offload` and CUDA); otherwise a no-op."""
    if not (offload and torch.cuda.is_available()):
        yield
        return
    device = compute_device()
    for c in chunks:
        c.to(device, non_blocking=True)
    try:
        yield
    finally:
        for c in chunks:
            c.to("cpu")
        torch.cuda.empty_cache()


def offload_now(chunks: List[torch.nn.Module], offload: bool) -> None:
    """Move a frozen model to host memory right after building it (`offload` and CUDA only)."""
    if offload and torch.cuda.is_available():
        for c in chunks:
            c.to("cpu")
