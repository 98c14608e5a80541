"""Checkpoints record a fingerprint of their tokenizer, and whatever loads one with another tokenizer is refused in
one line naming both directories, before anything is built (issue 22, item 6): a permuted vocabulary of the right
size and a smaller one whose ids shift are both caught; tokenizer.allow_swap=true lets a deliberate swap through;
checkpoints without a fingerprint (older ones, converted HF ones) load as before. A tokenizer without EOS is refused
for PPO, and one that cannot encode the data is blamed as `tokenizer.path`, not as malformed rows (item 14). A world
of one rank, in process."""

import json
import shutil
from types import SimpleNamespace

import pytest

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config import schema as C
from megatron_rlhf.data import dataset as D
from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.tasks import sort_digits
from megatron_rlhf.trainer.run import build_frozen, expected_tokenizer, resume_point
from tests.unit.test_checkpoint_damage import CFG, _models


def _tokenizer(directory, vocab, eos="<eos>"):
    """A word-level tokenizer like the tiny task's, over `vocab` (id = position), saved and loaded back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token=eos, pad_token="<pad>"
                            ).save_pretrained(directory)
    return T.load_tokenizer(str(directory))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    digits = [str(i) for i in range(10)]
    sort_digits.save_tokenizer(str(d / "tiny"))
    shutil.copytree(d / "tiny", d / "tiny_copy")
    return {
        "tiny": T.load_tokenizer(str(d / "tiny")),
        "copy": T.load_tokenizer(str(d / "tiny_copy")),  # the same tokenizer elsewhere
        "permuted": _tokenizer(d / "permuted", sort_digits.SPECIAL + sort_digits.OPS + ["="] + digits[::-1]),
        "smaller": _tokenizer(d / "smaller", sort_digits.SPECIAL + ["sort", "rev", "="] + digits),  # ids shift by 1
    }


@pytest.fixture(scope="module")
def sft(world, tokenizers, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft") / "checkpoints"
    ckpt.save_checkpoint(root, 2, _models(), {}, {}, {}, run=ckpt.RunRecord.new("sft", T.fingerprint(tokenizers["tiny"])))
    return root


@pytest.mark.parametrize("other, differ", [("permuted", "both have 17 tokens, mapped to other ids"),
                                           ("smaller", "17 tokens there, 16 here")])
def test_a_checkpoint_refuses_another_tokenizer_naming_both(sft, tokenizers, other, differ):
    """...before the model is built (`load_built` checks the checkpoint first)."""
    tiny, tok = tokenizers["tiny"].name_or_path, tokenizers[other].name_or_path
    built = []
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_built(sft, lambda initialise: built.append(initialise) or _models()["policy"], "policy", "lm",
                        tokenizer=T.fingerprint(tokenizers[other]))
    assert built == []
    assert str(e.value) == (
        f"model.load: {sft / 'step_00000002'} was trained with the tokenizer in '{tiny}', and tokenizer.path "
        f"'{tok}' is another one ({differ}): the model would read token ids that mean other words; set "
        f"tokenizer.path to '{tiny}' (or a copy), or tokenizer.allow_swap=true to swap tokenizers deliberately")
    assert "\n" not in str(e.value)


def test_the_same_tokenizer_elsewhere_loads_and_allow_swap_lets_another_through(sft, tokenizers):
    ckpt.load_model_weights(sft, _models()["policy"], "policy", "lm", tokenizer=T.fingerprint(tokenizers["copy"]))
    cfg = C.PPOConfig()
    assert expected_tokenizer(cfg, tokenizers["permuted"]) == T.fingerprint(tokenizers["permuted"])
    cfg.tokenizer.allow_swap = True
    assert expected_tokenizer(cfg, tokenizers["permuted"]) is None
    ckpt.load_model_weights(sft, _models()["policy"], "policy", "lm", tokenizer=None)


def test_every_model_a_stage_builds_is_checked_under_its_key(sft, tokenizers):
    """build_frozen/build_trainable (model.load, ppo.reward_load, ppo.value_load, the DPO reference) pass the
    run's fingerprint; the setting is named."""
    cfg = C.PPOConfig()
    for k, v in CFG.items():
        setattr(cfg.model, k, v)
    ctx = SimpleNamespace(model_cfg=ModelConfig(**CFG), tokenizer=tokenizers["smaller"])
    with pytest.raises(ckpt.CheckpointError, match=r"^ppo.value_load: .* was trained with the tokenizer in"):
        build_frozen(cfg, ctx, "scalar", str(sft), "policy", key="ppo.value_load")
    ctx.tokenizer = tokenizers["copy"]
    build_frozen(cfg, ctx, "lm", str(sft), "policy")
    # A reward model read with a tokenizer of its own: the error names the setting that gave that tokenizer
    with pytest.raises(ckpt.CheckpointError, match=r"^ppo.reward_load: .*, and ppo.reward_tokenizer '.*' is another "
                                                   r"one .* set ppo.reward_tokenizer to "):
        build_frozen(cfg, ctx, "scalar", str(sft), "policy", key="ppo.reward_load", tokenizer=tokenizers["smaller"],
                     tokenizer_setting="ppo.reward_tokenizer")


def test_checkpoints_without_a_fingerprint_load_as_before(world, tokenizers, tmp_path):
    old = tmp_path / "old"  # written before run records existed: no run.json at all
    ckpt.save_checkpoint(old, 2, _models(), {}, {}, {})
    recorded = tmp_path / "recorded"  # a run record from before fingerprints: stage and run id only
    ckpt.save_checkpoint(recorded, 2, _models(), {}, {}, {}, run=ckpt.RunRecord.new("sft"))
    assert set(json.loads((recorded / "step_00000002" / ckpt.RUN_RECORD).read_text())) == {"stage", "run_id"}
    for root in (old, recorded):
        ckpt.load_model_weights(root, _models()["policy"], "policy", "lm",
                                tokenizer=T.fingerprint(tokenizers["permuted"]))


def _cfg(run, allow_swap=False):
    return SimpleNamespace(checkpoint=SimpleNamespace(resume="auto", load=None, dir=None, overwrite=False),
                           logging=SimpleNamespace(run_dir=str(run)), tokenizer=SimpleNamespace(allow_swap=allow_swap))


def test_resuming_with_another_tokenizer_is_refused_and_a_swap_is_recorded(world, tokenizers, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    first = ckpt.RunRecord.new("ppo", T.fingerprint(tokenizers["tiny"]))
    ckpt.save_checkpoint(root, 2, _models(), {}, {}, {}, run=first)

    def ctx(tok):
        return SimpleNamespace(ckpt_root=str(root), run=ckpt.RunRecord.new("ppo", T.fingerprint(tok)), rank0=True,
                               log=None)

    with pytest.raises(ckpt.CheckpointError, match=r"^logging.run_dir: .*step_00000002 was trained with the "
                                                     r"tokenizer in .*\(17 tokens there, 16 here\)"):
        resume_point(_cfg(tmp_path / "run"), ctx(tokenizers["smaller"]))
    swapped = ctx(tokenizers["smaller"])
    assert resume_point(_cfg(tmp_path / "run", allow_swap=True), swapped) == root / "step_00000002"
    assert swapped.run.run_id == first.run_id and swapped.run.tokenizer == T.fingerprint(tokenizers["smaller"])


def test_a_tokenizer_without_eos_is_refused_for_ppo(tmp_path):
    tok = _tokenizer(tmp_path / "no_eos", sort_digits.VOCAB, eos=None)
    with pytest.raises(D.DataError) as e:
        T.require_eos(tok, "PPO")
    assert str(e.value).startswith(f"tokenizer.path: the tokenizer at '{tok.name_or_path}' has no EOS token, and "
                                   "PPO ends every response at EOS"), e.value
    T.require_eos(T.load_tokenizer(sort_digits.save_tokenizer(str(tmp_path / "tiny"))), "PPO")


def test_a_tokenizer_missing_the_tasks_digits_is_blamed_not_the_rows(tmp_path):
    import random

    rows = sort_digits.prompts(200, random.Random(0))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer(tmp_path / "no_7", [t for t in sort_digits.VOCAB if t != "7"])
    failing = sum("7" in r["prompt"].split() for r in rows)
    with pytest.raises(D.DataError) as e:
        D.load_examples("prompt", C.DataConfig(), tok, str(tmp_path / "prompts.jsonl"), log=None)
    first = next(i for i, r in enumerate(rows) if "7" in r["prompt"].split()) + 1
    assert str(e.value) == (f"tokenizer.path: the tokenizer in '{tok.name_or_path}' cannot encode {failing} of the "
                            f"200 rows of {tmp_path / 'prompts.jsonl'} (the first is row {first}): it lacks tokens "
                            "this data uses; use the tokenizer the data and the model were made with")
    assert "malformed" not in str(e.value)
