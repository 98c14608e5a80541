"""Config loading: YAML + overrides, one-line errors, model resolution, resolved config round trip."""

import dataclasses
import json
import os
import shutil

import pytest

from megatron_rlhf.config import model_file
from megatron_rlhf.config import schema as C
from megatron_rlhf.config import io as config_io
from megatron_rlhf.models.spec import ModelConfig


@pytest.fixture
def base(tmp_path):
    """Overrides that satisfy the required paths (data file, tokenizer dir)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    return [f"data.train_path={data}", f"tokenizer.path={tok}", f"logging.run_dir={tmp_path / 'run'}"]


def write_yaml(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def one_line_error(fn, *args):
    with pytest.raises(C.ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_yaml_then_overrides_in_order(tmp_path, base):
    yaml = write_yaml(tmp_path, "train:\n  lr: 1.0e-3\n  micro_batch_size: 2\nparallel:\n  tp: 2\n")
    cfg = C.load_config(C.SFTConfig, yaml, base + ["train.lr=5e-4", "train.global_batch_size=8", "train.lr=2e-4"])
    assert isinstance(cfg, C.SFTConfig) and isinstance(cfg.train, C.TrainConfig)
    assert cfg.train.lr == pytest.approx(2e-4)  # the last override wins
    assert cfg.train.micro_batch_size == 2 and cfg.train.global_batch_size == 8
    assert cfg.parallel.tp == 2 and cfg.parallel.pp == 1
    # derived defaults are filled in
    assert cfg.data.seed == cfg.train.seed
    assert cfg.checkpoint.dir == os.path.join(str(tmp_path / "run"), "checkpoints")


def test_yaml_1e_notation_is_a_float(tmp_path, base):
    yaml = write_yaml(tmp_path, "train:\n  lr: 1e-4\n")
    assert C.load_config(C.SFTConfig, yaml, base).train.lr == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("train.lrr=1", "train.lrr", "train.lr"),
        ("lr=1", "lr", "train.lr"),  # a leaf given without its group
        ("paralel.tp=2", "paralel", "parallel"),
        ("data.max_seq=3", "data.max_seq", "data.max_seq_len"),
        ("train.warmup=3", "train.warmup", "train.warmup_steps"),
    ],
)
def test_unknown_key_names_it_and_suggests(base, override, key, suggestion):
    message = one_line_error(C.load_config, C.SFTConfig, None, base + [override])
    assert f"'{key}'" in message and f"'{suggestion}'" in message


def test_unknown_key_in_yaml_names_the_file(tmp_path, base):
    yaml = write_yaml(tmp_path, "checkpoint:\n  keep_lst: 3\n")
    message = one_line_error(C.load_config, C.SFTConfig, yaml, base)
    assert "checkpoint.keep_lst" in message and "checkpoint.keep_last" in message and yaml in message


def test_rm_only_group_is_unknown_to_sft(base):
    message = one_line_error(C.load_config, C.SFTConfig, None, base + ["calibration.num_prompts=3"])
    assert "'calibration'" in message
    cfg = C.load_config(C.RMConfig, None, base + ["calibration.num_prompts=3"])
    assert cfg.calibration.num_prompts == 3


@pytest.mark.parametrize(
    "override, key, value, expected",
    [
        ("train.lr=abc", "train.lr", "'abc'", "float"),
        ("parallel.tp=1.5", "parallel.tp", "1.5", "int"),
        ("train.train_steps=many", "train.train_steps", "'many'", "int or null"),
        ("logging.tensorboard=maybe", "logging.tensorboard", "'maybe'", "bool"),
        ("model.hidden_size=null", "model.hidden_size", "None", "int"),
        ("train=5", "train", "5", "a mapping"),
    ],
)
def test_wrong_type_names_key_value_and_type(base, override, key, value, expected):
    message = one_line_error(C.load_config, C.SFTConfig, None, base + [override])
    assert f"'{key}'" in message and value in message and f"expected {expected}" in message


def test_wrong_type_in_yaml(tmp_path, base):
    yaml = write_yaml(tmp_path, "train:\n  global_batch_size: lots\n")
    message = one_line_error(C.load_config, C.SFTConfig, yaml, base)
    assert "train.global_batch_size" in message and "'lots'" in message and "int" in message


def test_missing_and_broken_yaml(tmp_path, base):
    message = one_line_error(C.load_config, C.SFTConfig, str(tmp_path / "nope.yaml"), base)
    assert "nope.yaml" in message and "not found" in message
    broken = write_yaml(tmp_path, "train: [1, 2\n", "broken.yaml")
    assert "broken.yaml" in one_line_error(C.load_config, C.SFTConfig, broken, base)
    listing = write_yaml(tmp_path, "- 1\n- 2\n", "list.yaml")
    assert "mapping" in one_line_error(C.load_config, C.SFTConfig, listing, base)
    scalar = write_yaml(tmp_path, "5\n", "scalar.yaml")
    assert "not a single value" in one_line_error(C.load_config, C.SFTConfig, scalar, base)
    comments = write_yaml(tmp_path, "# nothing set here\n", "comments.yaml")
    assert C.load_config(C.SFTConfig, comments, base).train.lr == C.load_config(C.SFTConfig, None, base).train.lr


def test_malformed_override(base):
    assert "key=value" in one_line_error(C.load_config, C.SFTConfig, None, base + ["train.lr"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("data.overlong=trunc", "did you mean 'truncate'"),
        ("train.lr_schedule=cosin", "did you mean 'cosine'"),
        ("train.global_batch_size=6", "multiple of train.micro_batch_size"),
        ("train.lr=0", "train.lr=0.0 must be > 0"),
        ("data.eval_fraction=1.5", "data.eval_fraction"),
        ("checkpoint.resume=sometimes", "checkpoint.resume"),
        ("data.eval_path=/nonexistent/x.jsonl", "data.eval_path"),
        ("model.num_query_groups=3", "num_query_groups=3"),
    ],
)
def test_semantic_errors(base, override, fragment):
    assert fragment in one_line_error(C.load_config, C.SFTConfig, None, base + [override])


def test_required_paths(tmp_path):
    assert "data.train_path" in one_line_error(C.load_config, C.SFTConfig, None, [])
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    assert "tokenizer.path" in one_line_error(C.load_config, C.SFTConfig, None, [f"data.train_path={data}"])
    glob_missing = f"data.train_path={tmp_path}/*.parquet"
    assert "not found" in one_line_error(C.load_config, C.SFTConfig, None, [glob_missing])


def test_interpolation(base):
    cfg = C.load_config(C.SFTConfig, None, base + ["checkpoint.dir=${logging.run_dir}/ckpt"])
    assert cfg.checkpoint.dir == cfg.logging.run_dir + "/ckpt"


def test_save_resolved_round_trip(tmp_path, base):
    cfg = C.load_config(C.RMConfig, None, base + ["train.lr=3e-4", "parallel.tp=2", "model.rope_scaling={type: linear, factor: 2.0}"])
    path = C.save_resolved(cfg, str(tmp_path / "run"))
    assert path == str(tmp_path / "run" / "config.yaml")
    text = open(path).read()
    assert "lr: 0.0003" in text and "calibration:" in text
    again = C.load_config(C.RMConfig, path, [])
    assert again == cfg


HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5e5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_model_from_hf_config(tmp_path, base):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF_LLAMA))
    cfg = C.load_config(C.SFTConfig, None, base + [f"model.hf_config={hf}"])
    m = cfg.model.to_model_config()
    assert type(m) is ModelConfig
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.vocab_size) == (3, 96, 2, 300)
    assert m.rotary_base == 5e5 and m.tie_embeddings
    # params_dtype is this run's choice, not the checkpoint's
    assert m.params_dtype == "float32"
    # an agreeing inline value is fine, a contradicting one is an error naming both
    C.load_config(C.SFTConfig, None, base + [f"model.hf_config={hf}", "model.hidden_size=96"])
    message = one_line_error(C.load_config, C.SFTConfig, None, base + [f"model.hf_config={hf}", "model.hidden_size=64"])
    assert "model.hidden_size=64" in message and "96" in message and "hf_config" in message
    # the saved config (source + filled fields) loads back unchanged
    again = C.load_config(C.SFTConfig, C.save_resolved(cfg, str(tmp_path / "run")), [])
    assert again == cfg
    # tokenizer.path defaults to the HF directory
    no_tok = [b for b in base if not b.startswith("tokenizer.")]
    assert C.load_config(C.SFTConfig, None, no_tok + [f"model.hf_config={hf}"]).tokenizer.path == str(hf)


def test_model_from_checkpoint_model_config(tmp_path, base):
    root = tmp_path / "ckpt"
    step = root / "iter_0000010"
    arch = ModelConfig(num_layers=6, hidden_size=48, ffn_hidden_size=80, num_attention_heads=3, num_query_groups=3, vocab_size=17)
    model_file.write_model_config(arch, str(step))
    (root / "latest").write_text("iter_0000010\n")
    for load in (root, step):  # the root (following `latest`) or the step directory itself
        cfg = C.load_config(C.SFTConfig, None, base + [f"model.load={load}"])
        assert cfg.model.to_model_config() == arch
    missing = one_line_error(C.load_config, C.SFTConfig, None, base + [f"model.load={tmp_path / 'nope'}"])
    assert "model.load" in missing


def test_inline_model_fields(base):
    cfg = C.load_config(C.SFTConfig, None, base + ["model.num_layers=4", "model.hidden_size=128", "model.vocab_size=17"])
    m = cfg.model.to_model_config()
    assert (m.num_layers, m.hidden_size, m.vocab_size) == (4, 128, 17)
    assert {f.name for f in dataclasses.fields(C.ModelSection)} >= {f.name for f in dataclasses.fields(ModelConfig)}


def test_batch_layout_and_steps():
    train = C.TrainConfig(global_batch_size=32, micro_batch_size=4)
    assert C.check_batch_layout(train, 2) == 4
    with pytest.raises(C.ConfigError, match="data-parallel size"):
        C.check_batch_layout(train, 3)
    assert C.total_train_steps(train, 10) == 10
    assert C.total_train_steps(C.TrainConfig(epochs=3), 10) == 30
    assert C.total_train_steps(C.TrainConfig(train_steps=7, epochs=3), 10) == 7


def test_describe_lists_every_group_and_key():
    text = C.describe(C.RMConfig)
    for group in ("model", "parallel", "fp8", "tokenizer", "data", "train", "checkpoint", "logging", "calibration"):
        assert f"\n{group}:" in "\n" + text
    for key in config_io.all_keys(C.RMConfig):
        assert key in text
    assert "ppo:" in C.describe(C.PPOConfig)


def test_tiny_examples_load(tmp_path, monkeypatch):
    from megatron_rlhf.tasks import sort_digits

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(tmp_path)
    sort_digits.write_tiny_task("runs/tiny/data", num_sft=20, num_sft_eval=5, num_pairs=20, num_pairs_eval=5, num_prompts=20, num_prompts_eval=5)
    sft = C.load_config(C.SFTConfig, os.path.join(repo, "examples/tiny/sft.yaml"), [])
    assert sft.model.vocab_size == len(sort_digits.VOCAB)
    os.makedirs("runs/tiny/sft/checkpoints")
    # run.sh writes these with `tiny-pairs` after SFT; any preference file stands in for them here.
    for name in ("sft_pairs", "sft_pairs_eval"):
        shutil.copy("runs/tiny/data/pairs.jsonl", f"runs/tiny/data/{name}.jsonl")
    rm = C.load_config(C.RMConfig, os.path.join(repo, "examples/tiny/rm.yaml"), [])
    assert rm.model.load == "runs/tiny/sft/checkpoints" and rm.calibration.prompts_path
