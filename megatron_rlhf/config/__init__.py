"""Configuration: every stage's settings as nested dataclasses, read from YAML + dotted overrides.

- `fields`: `ConfigError`, `require`, `help_field` (the building blocks every group uses).
- `model_file`: a model's architecture on disk (HF `config.json`, `model_config.json` beside checkpoints).
- `schema`: the groups shared by all stages and the stage configs (`SFTConfig`, `RMConfig`, `PPOConfig`,
  `DPOConfig`), with what a loaded config must satisfy.
- `io`: YAML + dotted overrides -> a structured config, `--help` text, the resolved config of a run.
- `generation`: sampling defaults from a checkpoint's generation_config.json, and the one a run writes.
- `ppo`, `dpo`, `rollout`: one module per stage group and its checks.

Nothing here builds a model or starts a process group: a config is checked in milliseconds.
"""
