"""Sampling defaults from a checkpoint's generation_config.json (config/generation.py): which values are taken,
where the file is found, that explicit keys win, that conversions carry the file, and the file a run writes."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlhf.config import generation as G
from megatron_rlhf.config import model_file
from megatron_rlhf.config import schema as C
from megatron_rlhf.models.spec import ModelConfig

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
ARCH = ModelConfig(max_position_embeddings=128)
TOK = SimpleNamespace(eos_token_id=2, bos_token_id=1, pad_token_id=0)  # the ids a run's tokenizer has


def write_gen(directory: Path, gen: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / G.GENERATION_CONFIG).write_text(json.dumps(gen))
    return directory / G.GENERATION_CONFIG


def converted(tmp_path: Path, gen=None, name="smol.mg") -> Path:
    """A checkpoint laid out as convert_hf_to_megatron writes it: the architecture next to it, the tokenizer files
    (generation_config.json among them) in tokenizer/."""
    d = tmp_path / name
    model_file.write_model_config(ARCH, str(d))
    if gen is not None:
        write_gen(d / "tokenizer", gen)
    return d


@pytest.fixture
def paths(tmp_path):
    """Overrides for the required paths of every stage (data file, tokenizer dir, reward checkpoint, run dir)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n')
    for d in ("tok", "rm"):
        (tmp_path / d).mkdir()
    return [f"data.train_path={data}", f"tokenizer.path={tmp_path / 'tok'}", f"ppo.reward_load={tmp_path / 'rm'}",
            "data.max_prompt_len=16", f"logging.run_dir={tmp_path / 'run'}"]


def ppo(paths, load, *overrides, yaml=None):
    return C.load_config(C.PPOConfig, yaml, [*paths, f"model.load={load}", *overrides])


# ---------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------


def test_values_the_sampler_has_are_taken_and_the_rest_named():
    taken, unusable, none_because = G.sampling_defaults(QWEN)
    assert taken == {"temperature": 0.7, "top_k": 20, "top_p": 0.8} and none_because is None
    assert unusable == ["repetition_penalty=1.05 (no such setting here)"]
    assert isinstance(taken["top_k"], int) and isinstance(taken["temperature"], float)
    # only keys present: transformers' implicit top_k=50 is not the checkpoint's setting
    assert G.sampling_defaults({"do_sample": True, "temperature": 1})[0] == {"temperature": 1.0}
    assert G.sampling_defaults({"bos_token_id": 1, "eos_token_id": 2}) == ({}, [], None)


@pytest.mark.parametrize("gen, why", [
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.9}, "do_sample=false"),
    ({"temperature": 0.0, "top_k": 5}, "temperature=0.0"),
    ({"do_sample": True, "temperature": -1}, "temperature=-1"),
])
def test_greedy_decoding_gives_no_defaults(gen, why):
    taken, unusable, none_because = G.sampling_defaults(gen)
    assert taken == {} and unusable == [] and why in none_because and "greedy" in none_because


@pytest.mark.parametrize("gen, bad", [
    ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.5}, "top_p=1.5"), ({"top_k": -1}, "top_k=-1"),
    ({"top_k": 2.5}, "top_k=2.5"), ({"top_k": True}, "top_k=True"), ({"temperature": "hot"}, "temperature='hot'"),
    ({"temperature": float("nan")}, "temperature=nan"), ({"min_p": 0.1}, "min_p=0.1"), ({"num_beams": 4}, "num_beams=4"),
])
def test_values_out_of_range_are_not_taken(gen, bad):
    taken, unusable, _ = G.sampling_defaults(gen)
    assert taken == {} and len(unusable) == 1 and unusable[0].startswith(bad)


# ---------------------------------------------------------------------------------------------
# load_config: defaults unless set, where the file is found
# ---------------------------------------------------------------------------------------------


def test_ppo_takes_the_converted_checkpoints_settings_unless_set(tmp_path, paths):
    load = converted(tmp_path, QWEN)
    cfg = ppo(paths, load)
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (0.7, 20, 0.8)
    line = G.note(cfg)
    assert "\n" not in line and str(load / "tokenizer" / G.GENERATION_CONFIG) in line
    assert "ppo.temperature=0.7, ppo.top_k=20, ppo.top_p=0.8" in line and "repetition_penalty=1.05" in line
    # set explicitly, even to the default value, in an override or in the YAML: the user's value stays
    cfg = ppo(paths, load, "ppo.temperature=1.0")
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (1.0, 20, 0.8)
    assert "ppo.temperature=1.0 (the file has 0.7)" in G.note(cfg)
    yaml = tmp_path / "ppo.yaml"
    yaml.write_text("ppo:\n  top_k: 0\n")
    cfg = ppo(paths, load, yaml=str(yaml))
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (0.7, 0, 0.8)


def test_no_file_changes_nothing_and_logs_nothing(tmp_path, paths):
    cfg = ppo(paths, converted(tmp_path))
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (1.0, 0, 1.0) and G.note(cfg) is None


def test_a_greedy_file_keeps_the_defaults_and_says_why(tmp_path, paths):
    cfg = ppo(paths, converted(tmp_path, {"do_sample": False, "temperature": 0.2}))
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (1.0, 0, 1.0)
    assert "do_sample=false" in G.note(cfg) and "ppo.temperature=1.0, ppo.top_k=0, ppo.top_p=1.0 stay" in G.note(cfg)


def test_the_resolved_config_reloads_to_the_same_values(tmp_path, paths):
    cfg = ppo(paths, converted(tmp_path, QWEN))
    again = C.load_config(C.PPOConfig, C.save_resolved(cfg, str(tmp_path / "run")), [])
    assert (again.ppo.temperature, again.ppo.top_k, again.ppo.top_p) == (0.7, 20, 0.8)


def test_training_checkpoint_root_step_dir_and_hf_source(tmp_path):
    root = tmp_path / "sft" / "checkpoints"  # an SFT run: model_config.json (+ generation_config.json) in the root
    model_file.write_model_config(ARCH, str(root))
    (root / "step_0000010").mkdir()
    (root / "latest").write_text("step_0000010\n")
    gen = write_gen(root, {"temperature": 0.5})
    assert G.find_generation_config(str(root)) == str(gen)
    assert G.find_generation_config(str(root / "step_0000010")) == str(gen)  # the step's root
    # a directory that is not a checkpoint root is not looked in
    write_gen(tmp_path / "models", {"temperature": 0.3})
    model_file.write_model_config(ARCH, str(tmp_path / "models" / "mine"))
    assert G.find_generation_config(str(tmp_path / "models" / "mine")) is None
    # a converted checkpoint without the file: the HF directory it came from
    hf = tmp_path / "hf"
    source_gen = write_gen(hf, {"temperature": 0.9})
    mg = converted(tmp_path, None, "from_hf.mg")
    (mg / "megatron_rlhf_meta.json").write_text(json.dumps({"source": str(hf)}))
    assert G.find_generation_config(str(mg)) == str(source_gen)
    # model.hf_config (the directory, or its config.json) after model.load
    (hf / "config.json").write_text("{}")
    assert G.find_generation_config(None, str(hf / "config.json")) == str(source_gen)
    assert G.find_generation_config(str(root), str(hf)) == str(gen)


def test_dpo_calibration_and_tiny_pairs_temperatures(tmp_path, paths):
    load = converted(tmp_path, QWEN)
    common = [*paths[:2], f"model.load={load}", "data.max_prompt_len=16"]
    dpo = C.load_config(C.DPOConfig, None, [*common, f"dpo.eval_prompts_path={tmp_path / 'prompts.jsonl'}"])
    assert dpo.dpo.temperature == 0.7 and "top_p=0.8 (no dpo.top_p here)" in G.note(dpo)
    no_eval = C.load_config(C.DPOConfig, None, common)
    assert no_eval.dpo.temperature == 1.0 and G.note(no_eval) is None  # DPO samples only for its evaluation
    policy = converted(tmp_path, {"temperature": 0.4}, "sft.mg")  # calibration samples calibration.policy_load
    rm = C.load_config(C.RMConfig, None, [*common, f"calibration.policy_load={policy}"])
    assert rm.calibration.temperature == 0.4
    from megatron_rlhf.trainer.pairs import sampling_temperature

    args = argparse.Namespace(policy=str(load), temperature=None)
    assert "--temperature=0.7" in sampling_temperature(args) and args.temperature == 0.7
    args = argparse.Namespace(policy=str(load), temperature=1.5)
    sampling_temperature(args)
    assert args.temperature == 1.5
    args = argparse.Namespace(policy=str(tmp_path / "rm"), temperature=None)
    assert sampling_temperature(args) is None and args.temperature == 1.0


def test_a_broken_file_is_one_line(tmp_path, paths):
    load = converted(tmp_path, {})
    (load / "tokenizer" / G.GENERATION_CONFIG).write_text("{not json")
    with pytest.raises(C.ConfigError) as info:
        ppo(paths, load)
    assert "\n" not in str(info.value) and G.GENERATION_CONFIG in str(info.value) and "fix or remove it" in str(info.value)


# ---------------------------------------------------------------------------------------------
# What a run writes
# ---------------------------------------------------------------------------------------------


def test_export_matches_the_tokenizer_and_the_runs_sampling():
    sampling = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "max_new_tokens": 64}
    out = G.for_export({"eos_token_id": 7, "_from_model_config": True, "repetition_penalty": 1.1}, 2, 1, 0, sampling)
    assert out["eos_token_id"] == 2 and (out["bos_token_id"], out["pad_token_id"]) == (1, 0)
    assert (out["do_sample"], out["temperature"], out["top_k"], out["top_p"]) == (True, 0.9, 0, 1.0)
    assert out["max_new_tokens"] == 64 and "repetition_penalty" not in out and "_from_model_config" not in out
    assert G.for_export({"eos_token_id": [5, 2], "max_length": 4096}, 2, sampling=sampling)["eos_token_id"] == [5, 2]
    assert "max_new_tokens" not in G.for_export({"max_length": 4096}, 2, sampling=sampling)
    passed = G.for_export(QWEN, 151645)  # no sampling: the checkpoint's own settings pass through
    assert passed["eos_token_id"] == QWEN["eos_token_id"] and passed["repetition_penalty"] == 1.05
    from transformers import GenerationConfig

    loaded = GenerationConfig.from_dict(out)
    loaded.validate(strict=True)  # transformers takes it as it is, without a warning
    assert (loaded.do_sample, loaded.top_k, loaded.eos_token_id) == (True, 0, 2)


def test_sft_passes_the_file_on_and_ppo_picks_it_up(tmp_path, paths):
    from megatron_rlhf.trainer.run import RunContext, generation_config, record_run

    src = converted(tmp_path, {"eos_token_id": 9, "temperature": 0.6, "do_sample": True})
    sft = C.load_config(C.SFTConfig, None, [*paths[:2], f"model.load={src}", f"logging.run_dir={tmp_path / 'sft'}"])
    ctx = RunContext(model_cfg=ARCH, world=1, dp_size=1, dp_rank=0, rank0=True, log=None, tokenizer=TOK,
                     ckpt_root=sft.checkpoint.dir, run=None)
    record_run(sft, ctx)
    written = json.loads((Path(sft.checkpoint.dir) / G.GENERATION_CONFIG).read_text())
    assert written == {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0, "temperature": 0.6, "do_sample": True}
    cfg = ppo(paths, sft.checkpoint.dir, "ppo.top_p=0.95")
    assert (cfg.ppo.temperature, cfg.ppo.top_p) == (0.6, 0.95)
    exported = generation_config(cfg, TOK)  # hf_policy's: what PPO sampled with
    assert (exported["temperature"], exported["top_k"], exported["top_p"], exported["eos_token_id"]) == (0.6, 0, 0.95, 2)
    assert exported["max_new_tokens"] == cfg.ppo.max_new_tokens
    # an SFT run from a checkpoint without one writes none (nothing to pass on); PPO's export always has one
    bare = C.load_config(C.SFTConfig, None, [*paths[:2], f"model.load={converted(tmp_path, None, 'bare.mg')}"])
    assert generation_config(bare, TOK) is None
    assert generation_config(ppo(paths, converted(tmp_path, None, "bare2.mg")), TOK)["temperature"] == 1.0


def test_hf_conversion_carries_the_file_both_ways(tmp_path, paths):
    from tests.unit import hf_tiny_models
    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR, hf_to_megatron, megatron_to_hf

    hf = hf_tiny_models.save("llama", tmp_path)
    write_gen(hf, QWEN)
    mg = hf_to_megatron(hf, tmp_path / "llama.mg")
    assert json.loads((mg / TOKENIZER_DIR / G.GENERATION_CONFIG).read_text()) == QWEN
    back = megatron_to_hf(mg, tmp_path / "llama.hf")
    assert json.loads((back / G.GENERATION_CONFIG).read_text()) == QWEN
    cfg = C.load_config(C.PPOConfig, None, [*paths, f"model.load={mg}", "data.max_prompt_len=16"])
    assert (cfg.ppo.temperature, cfg.ppo.top_k, cfg.ppo.top_p) == (0.7, 20, 0.8)


def test_gguf_conversion_carries_a_generation_config_with_the_tokenizers_eos(smollm2):
    """The real SmolLM2 (tests/conftest.py): transformers' generation config of the GGUF file reaches the
    converted checkpoint; its EOS is the tokenizer's, and it asks for no sampling settings."""
    from transformers import AutoTokenizer

    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR

    tok_dir = smollm2["megatron"] / TOKENIZER_DIR
    gen = json.loads((tok_dir / G.GENERATION_CONFIG).read_text())
    assert gen["eos_token_id"] == AutoTokenizer.from_pretrained(tok_dir).eos_token_id
    assert G.find_generation_config(str(smollm2["megatron"])) == str(tok_dir / G.GENERATION_CONFIG)
    assert G.sampling_defaults(gen)[0] == {}


def test_the_line_when_the_file_gives_nothing_the_run_takes(tmp_path, paths):
    ids_only = ppo(paths, converted(tmp_path, {"bos_token_id": 1, "eos_token_id": 2}, "ids.mg"))
    assert G.note(ids_only).endswith("sets no temperature/top_k/top_p: ppo.temperature=1.0, ppo.top_k=0, ppo.top_p=1.0 stay")
    all_set = ppo(paths, converted(tmp_path, {"temperature": 0.5}, "t.mg"), "ppo.temperature=0.9")
    assert "each of its settings is set explicitly; set explicitly: ppo.temperature=0.9 (the file has 0.5)" in G.note(all_set)
