"""A model's architecture on disk: an HF `config.json`, and the `model_config.json` written next to Megatron
checkpoints (or `megatron_rlhf_meta.json`, next to converted ones) from which `model.load` takes it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.models.spec import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"  # written next to Megatron checkpoints (see write_model_config)


def read_hf_config(path: str, key: str = "model.hf_config") -> dict:
    """The dict in an HF config.json given the file or its directory (`key`: the setting it came from, for errors)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"{key}: '{file}' not found: point it at an HF config.json or its directory")
    try:
        with open(file) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: '{file}' is not valid JSON ({e})") from None


def write_model_config(model: ModelConfig, directory: str, file: str = MODEL_CONFIG_FILE) -> str:
    """Write `model_config.json` (or `file`) into a checkpoint directory so `model.load` can find the architecture."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file)
    tmp = path + ".tmp"
    plain = ModelConfig(**{f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)})
    with open(tmp, "w") as fh:
        json.dump(plain.to_dict(), fh, indent=2)
    os.replace(tmp, path)
    return path


def read_model_config(directory: str, file: str = MODEL_CONFIG_FILE) -> Optional[ModelConfig]:
    """`ModelConfig` from `model_config.json` (or `file`) in a checkpoint root or step directory: looked up in
    `directory`, in the step directory its `latest` file names, then in its parent. None if absent."""
    candidates = [directory]
    latest = os.path.join(directory, "latest")
    if os.path.isfile(latest):
        with open(latest) as fh:
            candidates.append(os.path.join(directory, fh.read().strip()))
    candidates.append(os.path.dirname(os.path.abspath(directory)))
    for d in candidates:
        path = os.path.join(d, file)
        converted = os.path.join(d, "megatron_rlhf_meta.json")  # tools/convert_hf_to_megatron.py
        if file != MODEL_CONFIG_FILE:
            converted = path  # only a converted model's own architecture is in its meta file
        if os.path.isfile(path) or os.path.isfile(converted):
            with open(path if os.path.isfile(path) else converted) as fh:
                data = json.load(fh)
            data = data.get("model_config", data)
            known = {f.name for f in dataclasses.fields(ModelConfig)}
            return ModelConfig(**{k: v for k, v in data.items() if k in known})
    return None
