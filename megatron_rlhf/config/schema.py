"""Run configuration: nested dataclasses used as OmegaConf structured configs.

A run is described by one YAML file plus dotted command-line overrides::

    megatron-rlhf sft examples/tiny/sft.yaml train.lr=1e-4 parallel.tp=2

`load_config(SFTConfig, "sft.yaml", ["train.lr=1e-4"])` merges the dataclass defaults, the YAML and
the overrides (in that order), checks every key and type against the dataclasses, resolves the model
architecture (from an HF `config.json`, a Megatron checkpoint's `model_config.json`, or inline
fields) and returns plain dataclass instances. Every problem raises `ConfigError` with one line that
names the key, the value and the fix. The merging, type checks and messages are generic and live in
`config/io.py`; this module holds the groups and what a loaded config must satisfy. `save_resolved(cfg, run_dir)` writes the final config to
`<run_dir>/config.yaml`; loading that file again gives the same config.

Groups shared by all commands (`RunConfig`): model, parallel, fp8, tokenizer, data, train,
checkpoint, logging. `SFTConfig`, `RMConfig` (+ calibration), `PPOConfig` (+ ppo) and `DPOConfig` (+ dpo) add their own.
Relative paths are relative to the current working directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from megatron_rlhf.config import generation as G
from megatron_rlhf.config import io as config_io
from megatron_rlhf.config.model_file import read_hf_config, read_model_config
from megatron_rlhf.config.fields import ConfigError, help_field as _f, paths_exist, require as _require  # noqa: F401
from megatron_rlhf.models.spec import ModelConfig, model_config_from_hf
from megatron_rlhf.parallel.layout import Fp8Config, ParallelConfig
from megatron_rlhf.config.dpo import DPOSection, validate_dpo
from megatron_rlhf.config.ppo import PPOSection, validate_ppo
from megatron_rlhf.config.stage_models import check_other_models
from megatron_rlhf.config.rollout import RolloutSection


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------

# ModelConfig fields that are choices of this run rather than properties of the architecture:
# always taken from the `model` group, never from hf_config / model_config.json.
RUN_CHOICE_FIELDS = ("params_dtype", "make_vocab_size_divisible_by", "init_method_std")


@dataclass
class ModelSection(ModelConfig):
    """The `model` group: where the architecture (and initial weights) come from.

    Architecture source, first match wins:
      1. `hf_config`: an HF config.json (or the directory holding it);
      2. `load`: a Megatron checkpoint directory holding `model_config.json` (itself or its parent);
      3. the inline fields below (ModelConfig), e.g. `model.hidden_size=128`.
    With 1 or 2 the inline architecture fields are filled from the source by `load_config`; an inline
    value that contradicts the source is an error. `params_dtype`, `make_vocab_size_divisible_by`
    and `init_method_std` are always this run's choice.
    """

    hf_config: Optional[str] = None
    load: Optional[str] = None  # Megatron checkpoint to initialise the weights from (no optimizer state)

    def to_model_config(self) -> ModelConfig:
        """The plain `ModelConfig` (what models/build.py takes)."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})


# Help for fields of dataclasses defined elsewhere (models/spec.py, parallel/layout.py).
_EXTERNAL_HELP = {
    "model.hf_config": "HF config.json (or its directory): architecture source",
    "model.load": "Megatron checkpoint dir with initial weights (and model_config.json)",
    "model.num_layers": "decoder layers",
    "model.hidden_size": "model width",
    "model.ffn_hidden_size": "SwiGLU inner width",
    "model.num_attention_heads": "query heads",
    "model.num_query_groups": "key/value heads (GQA)",
    "model.kv_channels": "head dim; null = hidden_size / num_attention_heads",
    "model.vocab_size": "tokenizer vocabulary size",
    "model.max_position_embeddings": "longest sequence the RoPE tables cover",
    "model.rotary_base": "RoPE theta",
    "model.rope_scaling": "{type: llama3|linear, factor: F} or null",
    "model.norm_epsilon": "RMSNorm epsilon",
    "model.add_qkv_bias": "bias on the QKV projection (Qwen2)",
    "model.tie_embeddings": "share input embedding and LM head",
    "model.init_method_std": "weight init std (fresh weights only)",
    "model.sliding_window": "attention window; null = full",
    "model.family": "llama | mistral | qwen2 (HF names on export)",
    "model.make_vocab_size_divisible_by": "pad the vocab to a multiple of this * tp",
    "model.params_dtype": "float32 | bfloat16 | float16",
    "parallel.tp": "tensor-parallel size",
    "parallel.pp": "pipeline-parallel size",
    "parallel.vpp": "virtual pipeline chunks per pipeline rank; null = off",
    "parallel.cp": "context-parallel size",
    "parallel.sequence_parallel": "shard activations along the sequence (needs tp > 1)",
    "parallel.use_distributed_optimizer": "shard optimizer state over data-parallel ranks",
    "parallel.recompute": "activation recompute: null (off) | selective (attention) | full (every layer)",
    "fp8.format": "e4m3 | hybrid | null (off); GPU with Transformer Engine only",
    "fp8.recipe": "delayed | tensorwise | mxfp8 | blockwise",
    "fp8.amax_history_len": "amax history length (delayed scaling)",
    "fp8.amax_compute_algo": "max | most_recent",
    "fp8.margin": "scaling-factor margin",
}


@dataclass
class TokenizerConfig:
    path: Optional[str] = _f(
        None, "local HF tokenizer directory (default: model.hf_config's directory when it has one)"
    )
    allow_swap: bool = _f(False, "load checkpoints trained with another tokenizer (a deliberate swap; "
                                 "otherwise refused)")


@dataclass
class DataConfig:
    train_path: Optional[str] = _f(None, "training file, glob or directory (local only)")
    eval_path: Optional[str] = _f(None, "held-out file; otherwise eval_fraction of train_path is held out")
    format: Optional[str] = _f(
        None, "file format; null = from the extension", choices=(None, "jsonl", "json", "parquet", "arrow")
    )
    prompt_field: str = _f("prompt", "field holding the prompt text")
    response_field: str = _f("response", "field holding the SFT response text")
    messages_field: str = _f("messages", "field holding chat messages [{role, content}] (SFT)")
    chosen_field: str = _f("chosen", "field holding the preferred response (RM)")
    rejected_field: str = _f("rejected", "field holding the other response (RM)")
    append_eos: bool = _f(True, "append the tokenizer's EOS to responses (not to chat rows)")
    max_seq_len: int = _f(512, "maximum tokens per example (prompt + response)")
    max_prompt_len: Optional[int] = _f(None, "maximum prompt tokens for prompt-only data; null = max_seq_len")
    overlong: str = _f("truncate", "what to do with longer examples", choices=("truncate", "drop"))
    max_bad_fraction: float = _f(0.01, "stop with an error when more rows than this are malformed")
    eval_fraction: float = _f(0.0, "fraction of train rows held out for evaluation (when no eval_path)")
    seed: Optional[int] = _f(None, "shuffling / split seed; null = train.seed")
    num_proc: int = _f(1, "processes for tokenisation (datasets.map)")


@dataclass
class TrainConfig:
    lr: float = _f(1e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_schedule: str = _f("cosine", "decay after warmup", choices=("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "linear warmup steps")
    lr_decay_steps: Optional[int] = _f(None, "steps over which lr decays; null = all training steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    clip_grad: float = _f(1.0, "gradient-norm clip; 0 = off")
    global_batch_size: int = _f(32, "examples (RM: pairs) per optimizer step over all data-parallel ranks")
    micro_batch_size: int = _f(4, "examples per forward pass on one rank")
    max_tokens_per_micro_batch: Optional[int] = _f(
        None, "token budget of one micro-batch (rows grouped by length to fill it; packed: their tokens, padded: "
              "rows x the longest); null = micro_batch_size rows of the step's longest row (with packing on)")
    packing: bool = _f(True, "lay each micro-batch's rows end to end (no padding; attention within each row) in "
                              "every forward and training pass; off under context parallelism")
    train_steps: Optional[int] = _f(None, "optimizer steps; null = epochs * steps per epoch")
    epochs: int = _f(1, "passes over the training data when train_steps is null")
    exit_at_step: Optional[int] = _f(
        None, "save and stop at this step without changing the schedule (tests, time-limited jobs)"
    )
    seed: int = _f(1234, "seed for initialisation, dropout-free sampling and data order")
    eval_interval: int = _f(0, "evaluate every N steps; 0 = only at the end")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = _f(None, "checkpoint root; null = <logging.run_dir>/checkpoints")
    save_interval: int = _f(0, "save every N steps; 0 = only at the end (and on SIGTERM/SIGUSR1)")
    keep_last: int = _f(2, "number of most recent checkpoints kept")
    load: Optional[str] = _f(None, "resume from this checkpoint root instead of dir")
    resume: str = _f(
        "auto",
        "auto: resume when a checkpoint exists; never: start fresh; required: error without one",
        choices=("auto", "never", "required"),
    )
    overwrite: bool = _f(False, "a fresh start in a directory holding checkpoints moves them aside "
                                "(to <dir>/replaced-<time>/) instead of refusing to start")


@dataclass
class LoggingConfig:
    run_dir: str = _f("runs/run", "run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/")
    tensorboard: bool = _f(True, "write TensorBoard event files (rank 0)")
    progress_bar: bool = _f(True, "tqdm progress bar with ETA (rank 0)")
    log_interval: int = _f(10, "log scalars every N steps")


@dataclass
class CalibrationConfig:
    """Reward normalisation statistics: mean/std of RM scores on SFT-policy samples."""

    enabled: bool = _f(True, "run the calibration pass after RM training")
    num_prompts: int = _f(256, "prompts sampled from the SFT policy for the mean/std pass")
    prompts_path: Optional[str] = _f(None, "prompt-only file; null = the prompts of data.train_path")
    policy_load: Optional[str] = _f(None, "SFT checkpoint to sample from; null = model.load")
    max_new_tokens: int = _f(64, "sampling length limit")
    temperature: float = _f(1.0, "sampling temperature")
    batch_size: int = _f(32, "prompts per generation batch")


@dataclass
class RunConfig:
    """Groups shared by every training command."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass
class SFTConfig(RunConfig):
    """`megatron-rlhf sft`: supervised fine-tuning on (prompt, response) or chat rows."""


@dataclass
class RMConfig(RunConfig):
    """`megatron-rlhf rm`: Bradley-Terry reward model on (prompt, chosen, rejected) rows."""

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass
class PPOConfig(RunConfig):
    """`megatron-rlhf ppo`: PPO against a frozen reward model, KL-penalised to the SFT reference.

    `model.load` is the SFT checkpoint (policy init and the frozen reference); `data.train_path` /
    `data.eval_path` hold prompt rows; the `train` group sets the policy optimizer (lr, Adam, clipping,
    micro_batch_size); the `ppo` group the rest (config/ppo.py PPOSection).
    """

    ppo: PPOSection = field(default_factory=PPOSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass
class DPOConfig(RunConfig):
    """`megatron-rlhf dpo`: DPO on (prompt, chosen, rejected) rows against a frozen SFT reference.

    `model.load` is the SFT checkpoint (policy init and the reference); `train` sets the optimizer and
    `train.global_batch_size` pairs per step; the `dpo` group the rest (config/dpo.py DPOSection).
    """

    dpo: DPOSection = field(default_factory=DPOSection)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(cls: type, yaml_path: Optional[str] = None, overrides: Sequence[str] = ()) -> Any:
    """Defaults of `cls` <- YAML file <- `key=value` overrides, validated; returns a `cls` instance.

    Raises `ConfigError` (one line) for a missing/unreadable YAML file, an unknown key (with the closest
    valid key), a value of the wrong type, a malformed override or an invalid setting.
    """
    cfg, explicit = config_io.structured(cls, yaml_path, overrides)
    _finalize(cfg, explicit)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Model architecture resolution
# --------------------------------------------------------------------------------------------


def resolve_model(section: ModelSection, explicit: frozenset = frozenset()) -> None:
    """Fill the inline architecture fields from hf_config / load (see ModelSection)."""
    source, arch = None, None
    if section.hf_config is not None:
        arch, _head = model_config_from_hf(read_hf_config(section.hf_config))
        source = "model.hf_config"
    if section.load is not None:
        if not os.path.exists(section.load):
            raise ConfigError(f"model.load: checkpoint '{section.load}' not found")
        if arch is None:
            arch = read_model_config(section.load)
            source = "model.load" if arch is not None else None
    if arch is None:
        return  # inline architecture
    defaults = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        if f.name in RUN_CHOICE_FIELDS:
            continue
        mine, theirs, default = getattr(section, f.name), getattr(arch, f.name), getattr(defaults, f.name)
        if (mine != default or f"model.{f.name}" in explicit) and mine != theirs:
            raise ConfigError(
                f"model.{f.name}={mine!r} contradicts {source} ({theirs!r}): remove model.{f.name} or the source"
            )
        setattr(section, f.name, theirs)


def _finalize(cfg: Any, explicit: frozenset = frozenset()) -> None:
    """Derived defaults that depend on other keys (written into the resolved config)."""
    if isinstance(cfg, RunConfig):
        resolve_model(cfg.model, frozenset(explicit))
        if cfg.data.seed is None:
            cfg.data.seed = cfg.train.seed
        if cfg.checkpoint.dir is None:
            cfg.checkpoint.dir = os.path.join(cfg.logging.run_dir, "checkpoints")
        if cfg.tokenizer.path is None and cfg.model.hf_config and os.path.isdir(cfg.model.hf_config):
            cfg.tokenizer.path = cfg.model.hf_config
        _sampling_defaults(cfg, explicit)


def _sampling_defaults(cfg: RunConfig, explicit: frozenset) -> None:
    """Sampling keys the user did not set take the policy checkpoint's generation_config.json (config/generation.py)."""
    path = G.find_generation_config(cfg.model.load, cfg.model.hf_config)
    if path is not None:
        G.read_generation_config(path)  # a broken file is one line now, not when the run writes its own
    if isinstance(cfg, PPOConfig):
        section, prefix = cfg.ppo, "ppo."
    elif isinstance(cfg, DPOConfig) and cfg.dpo.eval_prompts_path is not None:
        section, prefix = cfg.dpo, "dpo."
    elif isinstance(cfg, RMConfig) and cfg.calibration.enabled:
        section, prefix = cfg.calibration, "calibration."
        path = G.find_generation_config(cfg.calibration.policy_load, cfg.model.load, cfg.model.hf_config)
    else:
        return
    G.set_note(cfg, G.apply_checkpoint_sampling(section, prefix, path, explicit))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        yield f"{prefix}{f.name}", value, f
        if dataclasses.is_dataclass(value):
            yield from _walk(value, f"{prefix}{f.name}.")


def validate(cfg: Any) -> None:
    """Semantic checks beyond types; raises `ConfigError`. Layout checks that need the world size
    are `megatron_rlhf.parallel.layout.validate_layout`, called by the trainer."""
    for key, value, f in _walk(cfg):
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices if c is not None], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            raise ConfigError(f"{key}={value!r} is not one of: {shown}{hint}")
    if not isinstance(cfg, RunConfig):
        return
    t, d, c, log = cfg.train, cfg.data, cfg.checkpoint, cfg.logging
    _require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _require(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        v = getattr(t, name)
        _require(0 <= v < 1, f"train.{name}={v} must be in [0, 1)")
    _require(t.adam_eps > 0, f"train.adam_eps={t.adam_eps} must be > 0")
    _require(t.clip_grad >= 0, f"train.clip_grad={t.clip_grad} must be >= 0 (0 = off)")
    _require(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    _require(
        isinstance(cfg, PPOConfig)  # PPO's batches are ppo.rollout_batch_size / ppo.minibatch_size
        or (t.global_batch_size >= 1 and t.global_batch_size % t.micro_batch_size == 0),
        f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
        f"train.micro_batch_size={t.micro_batch_size}",
    )
    _require(t.train_steps is None or t.train_steps >= 1, f"train.train_steps={t.train_steps} must be >= 1 or null")
    _require(t.epochs >= 1, f"train.epochs={t.epochs} must be >= 1")
    _require(t.eval_interval >= 0, f"train.eval_interval={t.eval_interval} must be >= 0")
    _require(
        t.exit_at_step is None or t.exit_at_step >= 1, f"train.exit_at_step={t.exit_at_step} must be >= 1 or null"
    )
    _require(d.max_seq_len >= 2, f"data.max_seq_len={d.max_seq_len} must be >= 2")
    _require(
        t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch >= d.max_seq_len,
        f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} is below data.max_seq_len={d.max_seq_len}, "
        "the longest row a micro-batch must hold: raise it to at least that, or lower data.max_seq_len",
    )
    _require(
        d.max_prompt_len is None or 1 <= d.max_prompt_len <= d.max_seq_len,
        f"data.max_prompt_len={d.max_prompt_len} must be between 1 and data.max_seq_len={d.max_seq_len}",
    )
    _require(0 <= d.max_bad_fraction <= 1, f"data.max_bad_fraction={d.max_bad_fraction} must be in [0, 1]")
    _require(0 <= d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    _require(
        not (d.eval_path and d.eval_fraction > 0),
        "set only one of data.eval_path and data.eval_fraction (the held-out data would be ambiguous)",
    )
    _require(d.num_proc >= 1, f"data.num_proc={d.num_proc} must be >= 1")
    _require(d.train_path is not None, "data.train_path is not set: give a jsonl/json/parquet/arrow file")
    for key in ("train_path", "eval_path"):
        p = getattr(d, key)
        _require(p is None or paths_exist(p), f"data.{key}: '{p}' not found (no file or glob match)")
    tok = cfg.tokenizer.path
    _require(tok is not None, "tokenizer.path is not set: give a local HF tokenizer directory")
    _require(os.path.isdir(tok), f"tokenizer.path: '{tok}' is not a directory (a local HF tokenizer dir is needed)")
    _require(c.save_interval >= 0, f"checkpoint.save_interval={c.save_interval} must be >= 0")
    _require(c.keep_last >= 1, f"checkpoint.keep_last={c.keep_last} must be >= 1")
    _require(log.log_interval >= 1, f"logging.log_interval={log.log_interval} must be >= 1")
    for name in ("tp", "pp", "cp"):
        v = getattr(cfg.parallel, name)
        _require(v >= 1, f"parallel.{name}={v} must be >= 1")
    m = cfg.model
    _require(
        m.params_dtype in ("float32", "bfloat16", "float16"),
        f"model.params_dtype={m.params_dtype!r} is not one of: float32, bfloat16, float16",
    )
    _require(
        m.hidden_size % m.num_attention_heads == 0 or m.kv_channels is not None,
        f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}: "
        "set model.kv_channels",
    )
    _require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
        f"model.num_query_groups={m.num_query_groups}",
    )
    if isinstance(cfg, PPOConfig):
        validate_ppo(cfg)
        check_other_models(cfg)
    if isinstance(cfg, DPOConfig):
        validate_dpo(cfg)
        check_other_models(cfg)
    if isinstance(cfg, RMConfig):
        cal = cfg.calibration
        _require(cal.num_prompts >= 1, f"calibration.num_prompts={cal.num_prompts} must be >= 1")
        _require(cal.batch_size >= 1, f"calibration.batch_size={cal.batch_size} must be >= 1")
        _require(cal.max_new_tokens >= 1, f"calibration.max_new_tokens={cal.max_new_tokens} must be >= 1")
        _require(cal.temperature > 0, f"calibration.temperature={cal.temperature} must be > 0")
        p = cal.prompts_path
        _require(p is None or paths_exist(p), f"calibration.prompts_path: '{p}' not found")


def check_batch_layout(train: TrainConfig, dp_size: int) -> int:
    """Number of micro-batches per step on each rank; `ConfigError` if the batch does not split evenly."""
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step != 0:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by micro_batch_size * "
            f"data-parallel size = {train.micro_batch_size}*{dp_size} = {per_step}: change one of them"
        )
    return train.global_batch_size // per_step


def total_train_steps(train: TrainConfig, steps_per_epoch: int) -> int:
    """`train.train_steps` when set, else `train.epochs * steps_per_epoch`."""
    return train.train_steps if train.train_steps is not None else train.epochs * steps_per_epoch


# --------------------------------------------------------------------------------------------
# Output and help
# --------------------------------------------------------------------------------------------


def save_resolved(cfg: Any, run_dir: str) -> str:
    """Write `<run_dir>/config.yaml` (atomically) and return its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(config_io.to_yaml(cfg))
    os.replace(tmp, path)
    return path


def describe(cls: type) -> str:
    """Human-readable list of the groups and fields of `cls`, with types, defaults and help."""
    return config_io.describe(cls, _EXTERNAL_HELP)
