"""The models of a stage besides the policy, each with the architecture of its own checkpoint.

InstructGPT scored policies up to 175B with one 6B reward model and a 6B value model: PPO's reward, value
and reference models and DPO's reference may have another size or shape than the policy (layers, hidden size,
heads, query groups, FFN, positions). Each is built from the `model_config.json` its checkpoint records (the
policy's architecture where it records none), in the layout it runs in:

    value      trained: the training layout (parallel.tp/pp/vpp), like the policy
    reward     frozen: the inference layout (TP = ppo.reward_inference_tp, else ppo.inference_tp; PP = 1) when set,
               else the training layout
    reference  frozen: the inference layout of ppo.inference_tp when set, else the training layout (DPO: the
               training layout)

They share the policy's vocabulary: log-probs and per-token values are taken on the policy's own tokens.

    for m in other_models(cfg): m.name, m.key, m.path, m.arch
    check_other_models(cfg, world)   # one line naming the model and the numbers that do not fit
    check_ppo_stage(cfg, dp_size)    # the PPO stage's checks at start (and the planner's)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.models.spec import ModelConfig

# The architecture a PPO run's critic records next to its checkpoints (the run's model_config.json is the
# policy's); a ppo.value_load pointing at a PPO run reads it.
VALUE_MODEL_CONFIG_FILE = "value_model_config.json"
# Fields that are this run's choice, not the checkpoint's architecture (as schema.RUN_CHOICE_FIELDS).
RUN_CHOICES = ("params_dtype", "make_vocab_size_divisible_by")
SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
         "vocab_size", "max_position_embeddings")


@dataclass(frozen=True)
class OtherModel:
    name: str  # reward | value | reference
    key: str  # the setting its weights come from (ppo.reward_load, ...), for errors
    path: Optional[str]  # None: a fresh model (never for these three in a real run)
    arch: ModelConfig  # its own architecture, with the run's dtype and vocabulary padding
    trained: bool
    inference_tp: Optional[int]  # the TP of its own inference layout; None: the training layout


def architecture_of(path: Optional[str], policy: ModelConfig, file: Optional[str] = None) -> ModelConfig:
    """The architecture recorded with checkpoint `path` (`file` first, e.g. a PPO run's value_model_config.json,
    then model_config.json / megatron_rlhf_meta.json), with the run's dtype and padding; `policy` when none is."""
    from megatron_rlhf.config.model_file import read_model_config

    found = None
    if path and os.path.exists(path):
        found = (read_model_config(path, file) if file else None) or read_model_config(path)
    return policy if found is None else _with_run_choices(found, policy)


def _with_run_choices(arch: ModelConfig, policy: ModelConfig) -> ModelConfig:
    """`arch` with this run's dtype and vocabulary padding (the policy's)."""
    return dataclasses.replace(arch, **{f: getattr(policy, f) for f in RUN_CHOICES})


def other_models(cfg) -> List[OtherModel]:
    """PPO: reward, value (unless critic-free) and reference (unless ppo.reference_mode=swap, which runs the policy's
    own model); DPO: its reference. Each with its own architecture."""
    from megatron_rlhf.config.ppo import critic_free, reference_source

    policy = cfg.model.to_model_config()
    ref_load, ref_key = reference_source(cfg)
    if not hasattr(cfg, "ppo"):  # DPO: the reference beside the policy, in the training layout
        return [OtherModel("reference", ref_key, ref_load, architecture_of(ref_load, policy), False, None)]
    p = cfg.ppo
    out = [OtherModel("reward", "ppo.reward_load", p.reward_load, reward_architecture(cfg, policy), False,
                      reward_inference_tp(p))]
    if not critic_free(p):
        if p.value_load:
            arch = architecture_of(p.value_load, policy, VALUE_MODEL_CONFIG_FILE)
            out.append(OtherModel("value", "ppo.value_load", p.value_load, arch, True, None))
        else:  # the critic starts from the reward model
            out.append(OtherModel("value", "ppo.reward_load", p.reward_load, out[0].arch, True, None))
    if p.reference_mode != "swap":
        out.append(OtherModel("reference", ref_key, ref_load, architecture_of(ref_load, policy), False, p.inference_tp))
    return out


def reward_inference_tp(p) -> Optional[int]:
    """The TP of the reward model's own inference layout (None: the training layout)."""
    return p.reward_inference_tp if p.reward_inference_tp is not None else p.inference_tp


def reward_architecture(cfg, policy: ModelConfig) -> ModelConfig:
    """The reward model's: its checkpoint's, else ppo.reward_hf_config's (a recipe planned away from its cluster),
    else the policy's. Both given and different: a one-line error."""
    p = cfg.ppo
    recorded = architecture_of(p.reward_load, policy)
    if p.reward_hf_config is None:
        return recorded
    from megatron_rlhf.config.model_file import read_hf_config
    from megatron_rlhf.models.spec import model_config_from_hf

    stated, _head = model_config_from_hf(read_hf_config(p.reward_hf_config, "ppo.reward_hf_config"))
    stated = _with_run_choices(stated, policy)
    if recorded is not policy:
        diff = [f for f in SHAPE if getattr(stated, f) != getattr(recorded, f)]
        if diff:
            raise ConfigError(
                f"ppo.reward_hf_config ({p.reward_hf_config}) has {_numbers(stated, diff)} but the reward model in "
                f"{p.reward_load} has {_numbers(recorded, diff)}: remove ppo.reward_hf_config or point it at that "
                "model's config.json")
    return stated


def _numbers(arch: ModelConfig, names) -> str:
    return ", ".join(f"{f}={getattr(arch, f)}" for f in names)


def check_other_models(cfg, world: Optional[int] = None) -> None:
    """Each model fits the layout it runs in and shares the policy's vocabulary (ConfigError, one line naming the
    model, its setting and the numbers). `world`: the ranks (None: the checks that need it are skipped)."""
    from megatron_rlhf.parallel.layout import LayoutError, validate_layout

    policy = cfg.model.to_model_config()
    prompt = cfg.data.max_prompt_len or cfg.data.max_seq_len
    longest = prompt + (cfg.ppo.max_new_tokens if hasattr(cfg, "ppo") else 0)
    own_tokenizer = getattr(getattr(cfg, "ppo", None), "reward_tokenizer", None)
    for m in other_models(cfg):
        what = f"the {m.name} model ({m.key}={m.path})"
        a = m.arch
        if own_tokenizer and m.name == "value" and m.key == "ppo.reward_load":
            raise ConfigError(
                f"{what} starts the critic from the reward model, which reads another tokenizer "
                f"(ppo.reward_tokenizer={own_tokenizer}): a value model gives a value per policy token, so it needs "
                "the policy's tokenizer; set ppo.value_load to a reward model trained with tokenizer.path, or use a "
                "critic-free ppo.advantage_estimator (grpo, rloo, remax)")
        # A reward model with its own tokenizer: its vocabulary is checked against that tokenizer at start
        # (trainer/ppo/reward_tokens.py load_reward_tokenizer); every other model reads the policy's tokens.
        reads_policy_tokens = not (own_tokenizer and m.name == "reward")
        if reads_policy_tokens and a.vocab_size != policy.vocab_size:
            raise ConfigError(
                f"{what} has vocab_size={a.vocab_size} but the policy has {policy.vocab_size}: a {m.name} model "
                "scores the policy's own tokens, so it needs the policy's tokenizer (train it from an SFT checkpoint "
                "with tokenizer.path of the policy)")
        if hasattr(cfg, "ppo") and a.max_position_embeddings < min(longest, policy.max_position_embeddings):
            raise ConfigError(
                f"{what} has max_position_embeddings={a.max_position_embeddings}, fewer than a prompt and its "
                f"response ({prompt} + {cfg.ppo.max_new_tokens}): lower data.max_prompt_len or ppo.max_new_tokens")
        if m.inference_tp is not None:
            if world is not None:
                from megatron_rlhf.config.rollout import check_layout_tp

                key = "ppo.reward_inference_tp" if m.name == "reward" and cfg.ppo.reward_inference_tp else "ppo.inference_tp"
                try:
                    check_layout_tp(key, m.inference_tp, world, a, cfg.parallel.tp)
                except ConfigError as e:
                    raise ConfigError(f"{what}: {e}") from None
            continue
        if a is policy:
            continue  # the policy's own numbers: checked with the policy
        try:
            validate_layout(cfg.parallel, world or cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp,
                            num_layers=a.num_layers, num_attention_heads=a.num_attention_heads,
                            num_query_groups=a.num_query_groups, cuda_available=True, te_available=True)
        except LayoutError as e:
            layout = "trains" if m.trained else "runs (ppo.inference_tp unset)" if hasattr(cfg, "ppo") else "runs"
            raise ConfigError(f"{what} {layout} in the policy's layout: {str(e).replace('model.', '')}") from None


def check_ppo_stage(cfg, dp_size: int) -> None:
    """The PPO stage's checks at start, before any work (the planner runs the same): the batch split and the
    generation layout (config/ppo.py check_ppo_layout), then every other model in the layout it runs in."""
    from megatron_rlhf.config.ppo import check_ppo_layout

    check_ppo_layout(cfg, dp_size)
    p = cfg.parallel
    check_other_models(cfg, dp_size * p.tp * p.pp * p.cp)
