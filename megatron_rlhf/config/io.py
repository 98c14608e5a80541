"""Structured configs over nested dataclasses, independent of what the groups hold: defaults <- YAML
file <- dotted `key=value` overrides merged with OmegaConf and type-checked against the dataclasses,
with every failure turned into one `ConfigError` line that names the key, the value and the fix
(closest valid key for a typo); plus the listing of keys, YAML output and the `--help` text.
`config/schema.py` holds the groups themselves and what a loaded config must satisfy.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, List, Optional, Sequence

from megatron_rlhf.config.fields import ConfigError


def structured(cls: type, yaml_path: Optional[str] = None, overrides: Sequence[str] = ()) -> tuple:
    """(instance of `cls` from defaults <- YAML <- overrides, the dotted keys the user set explicitly)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.structured(cls)
    explicit: set = set()  # dotted keys the user set: an explicit model field must agree with hf_config
    sources = [(_read_yaml(yaml_path), f"in {yaml_path}")] if yaml_path is not None else []
    sources += [(_parse_override(item), f"in override '{item}'") for item in overrides]
    for new, where in sources:
        merged = _merge(cls, merged, new, where)
        explicit.update(_leaf_keys(new))
    try:
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # interpolation / missing-value errors
        raise ConfigError(_omegaconf_message(cls, e, None, "")) from None
    return cfg, frozenset(explicit)


def _leaf_keys(node, prefix: str = "") -> list:
    from omegaconf import DictConfig

    keys = []
    for k in node.keys():
        value = node._get_node(k)
        if isinstance(value, DictConfig) and not value._is_none():
            keys.extend(_leaf_keys(value, f"{prefix}{k}."))
        else:
            keys.append(f"{prefix}{k}")
    return keys


def _read_yaml(path: str):
    import yaml
    from omegaconf import OmegaConf

    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found (cwd: {os.getcwd()}): pass an existing YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and not isinstance(node, yaml.MappingNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
            raise ConfigError(f"config file '{path}' must hold a mapping of groups (model:, train:, ...), not {kind}")
        data = OmegaConf.create(text) if node is not None else OmegaConf.create({})
    except ConfigError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None
    for keys, clock in _clock_scalars(node):
        OmegaConf.update(data, ".".join(keys), clock)
    return data


# YAML 1.1 reads an unquoted `2:00` or `4:00:00` as a base-60 integer (120, 14400): a Slurm time limit of
# 2 minutes would become 120 minutes. No field here wants base-60 numbers, so such a value stays as written.
_CLOCK = re.compile(r"[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+")


def _clock_scalars(node, keys=()) -> list:
    """[(key path, text)] of the plain (unquoted) base-60 integers under a YAML node (list items by index)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        children = [(str(key.value), value) for key, value in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(str(i), value) for i, value in enumerate(node.value)]
    else:
        children = []
    found = []
    for key, value in children:
        if isinstance(value, (yaml.MappingNode, yaml.SequenceNode)):
            found += _clock_scalars(value, keys + (key,))
        elif isinstance(value, yaml.ScalarNode) and value.style is None and _CLOCK.fullmatch(value.value):
            found.append((keys + (key,), value.value))
    return found


def _parse_override(item: str):
    from omegaconf import OmegaConf

    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}' is not key=value (example: train.lr=1e-4)")
    try:
        if _CLOCK.fullmatch(value.strip()):
            override = OmegaConf.create()
            OmegaConf.update(override, key, value.strip())
            return override
        return OmegaConf.from_dotlist([item])
    except Exception as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"override '{item}' could not be parsed: {first}") from None


def _merge(cls: type, base, new, source: str):
    from omegaconf import OmegaConf

    try:
        return OmegaConf.merge(base, new)
    except Exception as e:
        raise ConfigError(_omegaconf_message(cls, e, new, source)) from None


def _omegaconf_message(cls: type, e: Exception, new, source: str) -> str:
    """Turn an OmegaConf error into one line that names the key, value and fix."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    key = getattr(e, "full_key", None) or None
    where = f" ({source})" if source else ""
    if isinstance(e, ConfigKeyError) and key:
        return f"unknown config key '{key}'{where}: {_suggest(cls, key)}"
    if isinstance(e, MissingMandatoryValue) and key:
        return f"config key '{key}' has no value: set it in the YAML file or as {key}=..."
    if isinstance(e, ValidationError):
        if key is None and new is not None:
            key = _first_bad_group(cls, new)
        if key:
            value = OmegaConf.select(new, key, throw_on_missing=False) if new is not None else None
            expected = _type_name(_field_type(cls, key))
            return (
                f"config key '{key}' has value {value!r} of type {type(value).__name__}{where}: expected {expected}"
            )
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"invalid config{where}: {first}" + (f" (key '{key}')" if key else "")


def _first_bad_group(cls: type, new) -> Optional[str]:
    """A group given a scalar (`train: 5`) has no full_key in OmegaConf's error: find it ourselves."""
    from omegaconf import DictConfig

    for name, f in _dc_fields(cls).items():
        if dataclasses.is_dataclass(f) and name in new and not isinstance(new[name], DictConfig):
            return name
    return None


def _dc_fields(cls: type) -> dict:
    """name -> resolved type for the fields of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unwrap_optional(tp):
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp, True
    return tp, False


def _field_type(cls: type, dotted: str):
    tp: Any = cls
    for part in dotted.split("."):
        inner, _ = _unwrap_optional(tp)
        if not dataclasses.is_dataclass(inner):
            return None
        fields = _dc_fields(inner)
        if part not in fields:
            return None
        tp = fields[part]
    return tp


def _type_name(tp) -> str:
    if tp is None:
        return "a valid value"
    inner, optional = _unwrap_optional(tp)
    if dataclasses.is_dataclass(inner):
        name = "a mapping (a config group)"
    else:
        name = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
    return f"{name} or null" if optional else name


def all_keys(cls: type, prefix: str = "") -> list:
    """Every dotted leaf key of config class `cls` (groups expanded)."""
    keys = []
    for name, tp in _dc_fields(cls).items():
        inner, _ = _unwrap_optional(tp)
        full = f"{prefix}{name}"
        if dataclasses.is_dataclass(inner):
            keys.extend(all_keys(inner, full + "."))
        else:
            keys.append(full)
    return keys


def _suggest(cls: type, key: str) -> str:
    """'did you mean ...' for an unknown dotted key: a close sibling, then the same leaf elsewhere."""
    parent, _, leaf = key.rpartition(".")
    parent_type = _unwrap_optional(_field_type(cls, parent))[0] if parent else cls
    if dataclasses.is_dataclass(parent_type):
        siblings = list(_dc_fields(parent_type))
        close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        if close:
            return f"did you mean '{parent + '.' if parent else ''}{close[0]}'?"
    everything = all_keys(cls)
    same_leaf = [k for k in everything if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return f"did you mean '{same_leaf[0]}'?"
    close = difflib.get_close_matches(key, everything, n=1, cutoff=0.5)
    if not close:
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in everything}
        leaf_close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaf_close[0]]] if leaf_close else []
    if close:
        return f"did you mean '{close[0]}'?"
    if dataclasses.is_dataclass(parent_type):
        return f"valid keys{' in ' + repr(parent) if parent else ''}: {', '.join(_dc_fields(parent_type))}"
    return "see --help for the valid keys"


def to_yaml(cfg: Any) -> str:
    """The config as YAML text (loadable again with `load_config`)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def describe(cls: type, external_help: Optional[dict] = None) -> str:
    """Human-readable list of the groups and fields of `cls`, with types, defaults and help."""
    lines = []
    defaults = cls()
    for group, tp in _dc_fields(cls).items():
        inner, _ = _unwrap_optional(tp)
        if not dataclasses.is_dataclass(inner):
            continue
        doc = (inner.__doc__ or "").strip().splitlines()[0] if inner.__doc__ else ""
        if doc.startswith(f"{inner.__name__}("):  # dataclass auto-doc: not helpful
            doc = ""
        lines.append(f"{group}:" + (f"  # {doc}" if doc else ""))
        lines.extend(_describe_fields(inner, getattr(defaults, group), group, external_help or {}))
    return "\n".join(lines)


def _describe_fields(cls: type, obj, prefix: str, external_help: dict) -> List[str]:
    """One line per field of dataclass `cls` under `prefix` (nested groups such as rollout.vllm: their fields)."""
    lines, hints = [], _dc_fields(cls)
    for f in dataclasses.fields(cls):
        default = getattr(obj, f.name)
        if dataclasses.is_dataclass(default):
            lines.extend(_describe_fields(type(default), default, f"{prefix}.{f.name}", external_help))
            continue
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        help_text = f.metadata.get("help") or external_help.get(f"{prefix}.{f.name}", "")
        choices = f.metadata.get("choices")
        if choices:
            help_text += " [" + "|".join("null" if c is None else str(c) for c in choices) + "]"
        left = f"  {prefix}.{f.name} ({_type_name(hints[f.name])}) = {shown}"
        lines.append(f"{left:<58} {help_text}".rstrip())
    return lines
