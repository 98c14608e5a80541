"""Sampling defaults from a checkpoint's `generation_config.json` (Hugging Face format), and the file a run writes.

A model often ships how it is meant to be sampled: SmolLM2 or Qwen2.5-Instruct hold
``{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": ...}`` next to the
weights. When the policy checkpoint has one, its temperature / top_k / top_p become the defaults of the
stage's sampling keys (`ppo.temperature`, `ppo.top_k`, `ppo.top_p`; `dpo.temperature`;
`calibration.temperature`) that the user did not set (in the YAML or an override): `load_config` applies
them (`apply_checkpoint_sampling`), so the resolved config.yaml holds the values the run used, and the run
logs one line naming them (`note`).

Where the file is looked for (`find_generation_config`), first match wins: the checkpoint directory
(`model.load`) itself, its `tokenizer/` (a converted checkpoint keeps it there), the step directory its
`latest` names, its parent when that is a checkpoint root (a step directory was given), the HF directory a
converted checkpoint came from (`megatron_rlhf_meta.json` "source"), then `model.hf_config`'s directory.

Rules for what the sampler cannot use (docs/ppo.md): PPO needs samples, so a file that asks for greedy
decoding (``do_sample: false``, or ``temperature <= 0``) gives no sampling defaults at all; a value out of
range (``top_p`` outside (0, 1], a negative or fractional ``top_k``, a non-number) is not taken; settings
the sampler does not have (``repetition_penalty``, ``min_p``, beams, ...) are named as not used. Keys
present in the file are the only ones taken: transformers' own implicit defaults (e.g. top_k=50) are not.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

from megatron_rlhf.config.fields import ConfigError

GENERATION_CONFIG = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
# Sampling settings of transformers that our sampler (and PPO's log-probs) do not have, with their neutral
# value: a file that sets one to anything else is sampled differently by transformers than by us.
UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "num_beams": 1, "encoder_repetition_penalty": 1.0}
_NOTE = "_generation_note"  # attribute of a loaded config: the line the run logs at start (not a config key)


# --------------------------------------------------------------------------------------------
# Finding and reading the file
# --------------------------------------------------------------------------------------------


def _candidates(load: str) -> List[str]:
    """Directories that may hold the generation config of checkpoint `load`, in order."""
    out = [load, os.path.join(load, "tokenizer")]  # checkpoint/hf.py TOKENIZER_DIR of a converted checkpoint
    latest = os.path.join(load, "latest")
    if os.path.isfile(latest):
        with open(latest) as fh:
            out.append(os.path.join(load, fh.read().strip()))
    parent = os.path.dirname(os.path.abspath(load))
    # Only a checkpoint root, never whatever directory a checkpoint happens to sit in.
    if any(os.path.isfile(os.path.join(parent, f)) for f in ("latest", "model_config.json")):
        out.append(parent)
    meta = os.path.join(load, "megatron_rlhf_meta.json")  # converted checkpoints record their HF source
    if os.path.isfile(meta):
        try:
            with open(meta) as fh:
                source = json.load(fh).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if isinstance(source, str) and os.path.isdir(source):
            out.append(source)
    return out


def find_generation_config(*sources: Optional[str]) -> Optional[str]:
    """Path of the first generation_config.json for the checkpoints / HF directories `sources` (None skipped),
    e.g. `find_generation_config(cfg.model.load, cfg.model.hf_config)`; None when there is none."""
    for src in sources:
        if not src or not os.path.exists(src):
            continue
        dirs = _candidates(src) if os.path.isdir(src) else [os.path.dirname(os.path.abspath(src))]  # a config.json
        for d in dirs:
            path = os.path.join(d, GENERATION_CONFIG)
            if os.path.isfile(path):
                return path
    return None


def read_generation_config(path: str) -> Dict[str, Any]:
    """The dict in a generation_config.json; `ConfigError` (one line naming the file) when it is not one."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"'{path}' is not a readable JSON file ({e}): fix or remove it (the run takes its "
                          "sampling defaults from it)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' holds a {type(data).__name__}, not a JSON object: fix or remove it")
    return data


# --------------------------------------------------------------------------------------------
# The rule: which values of the file are sampling defaults
# --------------------------------------------------------------------------------------------


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def sampling_defaults(gen: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str], Optional[str]]:
    """generation_config dict -> (usable {temperature: float, top_k: int, top_p: float} present in it,
    ["key=value (why not)", ...] of values it sets that are not usable, the reason it gives none at all or
    None). Greedy decoding (do_sample false, temperature <= 0) gives none: PPO cannot learn from argmax
    samples, so the stage's own defaults stay."""
    if gen.get("do_sample") is False:
        return {}, [], "it asks for greedy decoding (do_sample=false)"
    t = gen.get("temperature")
    if _number(t) and t <= 0:
        return {}, [], f"it asks for greedy decoding (temperature={t})"
    taken: Dict[str, Any] = {}
    unusable: List[str] = []
    if _number(t):
        taken["temperature"] = float(t)
    elif t is not None:
        unusable.append(f"temperature={t!r} (not a number)")
    k = gen.get("top_k")
    if k is not None:
        if _number(k) and k >= 0 and float(k).is_integer():
            taken["top_k"] = int(k)  # 0: off, as in transformers
        else:
            unusable.append(f"top_k={k!r} (not an integer >= 0)")
    p = gen.get("top_p")
    if _number(p) and 0 < p <= 1:
        taken["top_p"] = float(p)  # 1: off
    elif p is not None:
        unusable.append(f"top_p={p!r} (not in (0, 1])")
    for key, neutral in UNSUPPORTED.items():
        if gen.get(key, neutral) != neutral:
            unusable.append(f"{key}={gen[key]!r} (no such setting here)")
    return taken, unusable, None


def apply_checkpoint_sampling(section, prefix: str, path: Optional[str], explicit: Iterable[str]) -> Optional[str]:
    """Set the sampling fields of `section` (those of SAMPLING_KEYS it has; named `prefix` + key, e.g.
    "ppo.temperature") from the generation config at `path`, except the keys in `explicit` (the dotted keys
    the user set). Returns the one line the run logs (None without a file)."""
    if path is None:
        return None
    taken, unusable, none_because = sampling_defaults(read_generation_config(path))
    mine = [k for k in SAMPLING_KEYS if hasattr(section, k)]
    current = ", ".join(f"{prefix}{k}={getattr(section, k)}" for k in mine)
    if none_because:
        return f"sampling: {path}: {none_because}, but this stage samples: {current} stay"
    used, overridden, explicit = [], [], set(explicit)
    for key, value in taken.items():
        if key not in mine:
            unusable.append(f"{key}={value!r} (no {prefix}{key} here)")
        elif f"{prefix}{key}" in explicit:
            overridden.append(f"{prefix}{key}={getattr(section, key)} (the file has {value})")
        else:
            setattr(section, key, value)
            used.append(f"{prefix}{key}={value}")
    if used:
        parts = [f"sampling: {path} gives " + ", ".join(used) + " (set a key to override)"]
    elif overridden:
        parts = [f"sampling: {path}: each of its settings is set explicitly"]
    else:
        parts = [f"sampling: {path} sets no {'/'.join(mine)}: {current} stay"]
    if overridden:
        parts.append("set explicitly: " + ", ".join(overridden))
    if unusable:
        parts.append("not used: " + ", ".join(unusable))
    return "; ".join(parts)


def set_note(cfg, line: Optional[str]) -> None:
    """Keep the start-up line on the loaded config (an attribute, not a key: config.yaml does not hold it)."""
    if line:
        setattr(cfg, _NOTE, line)


def note(cfg) -> Optional[str]:
    """The line `load_config` left for the run to log at start (which sampling settings came from the checkpoint)."""
    return getattr(cfg, _NOTE, None)


# --------------------------------------------------------------------------------------------
# The file a run writes (next to its checkpoints; PPO also into hf_policy)
# --------------------------------------------------------------------------------------------


def for_export(base: Optional[Dict[str, Any]], eos_id: Optional[int], bos_id: Optional[int] = None,
               pad_id: Optional[int] = None, sampling: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The generation_config.json of a model this run trained: `base` (the checkpoint's, or {}) with its token
    ids made consistent with the run's tokenizer, and `sampling` ({temperature, top_k, top_p, max_new_tokens},
    what PPO sampled with; None to keep base's) written out in full.

    eos_token_id: base's when it is the tokenizer's EOS or a list holding it, else the tokenizer's EOS (the
    token every response of this run ended with). With `sampling`, top_k is written even when 0 (transformers
    would otherwise apply its top_k=50) and the sampling settings the run did not have are dropped, so
    transformers samples the trained policy as the run did."""
    out = dict(base or {})
    if eos_id is not None:
        have = out.get("eos_token_id")
        ok = have == eos_id or (isinstance(have, list) and eos_id in have)
        out["eos_token_id"] = have if ok else eos_id
    for key, value in (("bos_token_id", bos_id), ("pad_token_id", pad_id)):
        if value is not None:
            out[key] = value
    if sampling is not None:
        for key in UNSUPPORTED:
            out.pop(key, None)
        out.pop("_from_model_config", None)  # no longer derived from config.json alone
        out.update(do_sample=True, temperature=float(sampling["temperature"]), top_k=int(sampling["top_k"]),
                   top_p=float(sampling["top_p"]))
        if "max_new_tokens" not in out and "max_length" not in out and sampling.get("max_new_tokens"):
            out["max_new_tokens"] = int(sampling["max_new_tokens"])  # transformers' default is 20 tokens in all
    return out
