"""DPO pieces on one process: the trainer's loss on a fixed batch against a direct computation from
per-sequence log-probabilities, and the `dpo` config group's one-line errors."""

import math

import pytest
import torch

from megatron_rlhf.config import schema as C
from megatron_rlhf.data.collate import collate_preference
from megatron_rlhf.trainer.dpo.fit import dpo_batch_loss, sequence_logprobs

VOCAB, PADDED = 11, 13  # logits carry 2 padded ids (Megatron's vocab padding): they must get probability 0


def fixed_batch():
    """Three pairs with prompts of different lengths and responses of different lengths, plus logits."""
    examples = [
        {"prompt_len": 3, "chosen_ids": [1, 4, 5, 6, 7, 2], "rejected_ids": [1, 4, 5, 8, 2]},
        {"prompt_len": 2, "chosen_ids": [1, 9, 3, 2], "rejected_ids": [1, 9, 10, 10, 3, 2]},
        {"prompt_len": 4, "chosen_ids": [1, 3, 3, 3, 5, 2], "rejected_ids": [1, 3, 3, 3, 6, 6, 2]},
    ]
    batch = collate_preference(examples, pad_id=0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, batch["input_ids"].shape[1], PADDED, generator=g, dtype=torch.float64)
    return examples, batch, logits


def direct_logp(logits_row, ids, prompt_len):
    """sum over response tokens k >= prompt_len of log softmax(logits[k - 1])[ids[k]] over the TRUE vocab."""
    total = 0.0
    for k in range(prompt_len, len(ids)):
        z = logits_row[k - 1, :VOCAB].tolist()
        total += z[ids[k]] - math.log(sum(math.exp(v) for v in z))
    return total


@pytest.mark.parametrize("beta, smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_loss_on_a_fixed_batch_equals_a_direct_computation(beta, smoothing):
    examples, batch, logits = fixed_batch()
    rows = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    prompts = [e["prompt_len"] for e in examples] * 2
    policy = [direct_logp(logits[i], rows[i], prompts[i]) for i in range(6)]
    ref = [-3.0, -2.5, -4.0, -3.5, -6.0, -1.0]
    batch["ref_logps"] = torch.tensor(ref)

    got = sequence_logprobs(logits, batch, VOCAB)
    assert got.tolist() == pytest.approx(policy, abs=1e-10)

    logits.requires_grad_(True)
    loss_sum, n, stats = dpo_batch_loss(logits, batch, vocab_size=VOCAB, beta=beta, label_smoothing=smoothing)
    margins = [beta * ((policy[i] - ref[i]) - (policy[i + 3] - ref[i + 3])) for i in range(3)]
    log_sig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    expected = sum(-(1 - smoothing) * log_sig(m) - smoothing * log_sig(-m) for m in margins)
    assert n.item() == 3
    assert loss_sum.item() == pytest.approx(expected, rel=1e-6)
    mean = lambda name: (stats[name][0] / stats[name][1]).item()  # noqa: E731
    assert mean("loss") == pytest.approx(expected / 3, rel=1e-6)
    assert mean("reward_margin") == pytest.approx(sum(margins) / 3, rel=1e-5)
    assert mean("reward_accuracy") == pytest.approx(sum(m > 0 for m in margins) / 3)
    assert mean("chosen_logp") == pytest.approx(sum(policy[:3]) / 3, rel=1e-6)
    assert mean("rejected_logp") == pytest.approx(sum(policy[3:]) / 3, rel=1e-6)
    assert mean("chosen_reward") == pytest.approx(beta * sum(policy[i] - ref[i] for i in range(3)) / 3, rel=1e-5)

    loss_sum.backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    # Prompt positions (before prompt_len - 1), padding and the padded vocabulary get no gradient.
    assert grad[0, :1].abs().max() == 0 and grad[:, :, VOCAB:].abs().max() == 0
    last = int(batch["lengths"][1])  # row 1 is shorter than the batch: positions from its last token on are padding
    assert grad[1, last - 1:].abs().max() == 0


def test_policy_equal_to_reference_gives_log2_and_no_accuracy():
    _, batch, logits = fixed_batch()
    batch["ref_logps"] = sequence_logprobs(logits, batch, VOCAB)
    loss_sum, n, stats = dpo_batch_loss(logits, batch, vocab_size=VOCAB, beta=0.1, label_smoothing=0.0)
    assert (loss_sum / n).item() == pytest.approx(math.log(2), rel=1e-6)
    assert stats["reward_accuracy"][0].item() == 0  # ties count as wrong


@pytest.fixture
def paths(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "sft").mkdir()
    return [f"data.train_path={data}", f"tokenizer.path={tmp_path / 'tok'}", f"model.load={tmp_path / 'sft'}",
            f"logging.run_dir={tmp_path / 'run'}"]


@pytest.mark.parametrize("override, culprit", [
    ("dpo.beta=0", "dpo.beta=0"),
    ("dpo.beta=-1", "dpo.beta=-1"),
    ("dpo.label_smoothing=0.5", "dpo.label_smoothing=0.5"),
    ("dpo.reference_logprobs=onlin", "dpo.reference_logprobs='onlin'"),
    ("dpo.eval_prompts_path=/nonexistent/p.jsonl", "dpo.eval_prompts_path"),
    ("dpo.gold_scorer=megatron_rlhf.tasks.sort_digits:nope", "dpo.gold_scorer"),
    ("dpo.gold_scorer=megatron_rlhf.tasks.sort_digits:VOCAB", "dpo.gold_scorer='megatron_rlhf.tasks.sort_digits:VOCAB' is a list"),
    ("model.load=null", "model.load"),
])
def test_bad_dpo_settings_fail_in_one_line_naming_the_key(paths, override, culprit):
    with pytest.raises(C.ConfigError) as info:
        C.load_config(C.DPOConfig, None, paths + [override])
    message = str(info.value)
    assert "\n" not in message and culprit in message, message


def test_reference_load_sets_the_reference_with_its_own_architecture(paths, tmp_path):
    """dpo.reference_load (a policy continuing from a DPO run keeps its SFT reference) is where the reference
    comes from; a checkpoint of another size is built with its own architecture, and one that does not fit the
    layout is refused by the config check, before any work."""
    from megatron_rlhf.config.stage_models import other_models
    from megatron_rlhf.config import model_file
    from megatron_rlhf.config.ppo import reference_source
    from megatron_rlhf.models.spec import ModelConfig

    cfg = C.load_config(C.DPOConfig, None, paths)
    assert reference_source(cfg) == (str(tmp_path / "sft"), "model.load")
    cfg = C.load_config(C.DPOConfig, None, paths + [f"dpo.reference_load={tmp_path / 'sft'}"])
    assert reference_source(cfg) == (str(tmp_path / "sft"), "dpo.reference_load")
    arch = {f: getattr(cfg.model, f) for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                "num_query_groups", "vocab_size", "max_position_embeddings")}
    other = str(tmp_path / "other")
    model_file.write_model_config(ModelConfig(**{**arch, "num_layers": arch["num_layers"] + 1}), other)
    cfg = C.load_config(C.DPOConfig, None, paths + [f"dpo.reference_load={other}"])
    [reference] = other_models(cfg)
    assert reference.arch.num_layers == arch["num_layers"] + 1 and reference.key == "dpo.reference_load"
    odd = arch["num_layers"] + 1 if arch["num_layers"] % 2 == 0 else arch["num_layers"] + 2
    model_file.write_model_config(ModelConfig(**{**arch, "num_layers": odd}), other)
    with pytest.raises(C.ConfigError, match=rf"^the reference model \(dpo.reference_load=.*\) runs in the "
                                            rf"policy's layout: num_layers={odd} is not divisible by pp=2"):
        C.load_config(C.DPOConfig, None, paths + [f"dpo.reference_load={other}", "parallel.pp=2"])


def test_eval_prompts_need_a_sampling_layout(paths, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    with pytest.raises(C.ConfigError, match="dpo.max_new_tokens 64 exceeds model.max_position_embeddings=512"):
        C.load_config(C.DPOConfig, None, paths + [f"dpo.eval_prompts_path={prompts}"])
    ok = paths + [f"dpo.eval_prompts_path={prompts}", "data.max_prompt_len=64"]
    cfg = C.load_config(C.DPOConfig, None, ok)
    assert cfg.dpo.reference_logprobs == "precompute" and cfg.dpo.beta == 0.1
    with pytest.raises(C.ConfigError, match="parallel.pp=1"):
        C.load_config(C.DPOConfig, None, ok + ["parallel.pp=2"])


@pytest.mark.parametrize("mode", ["online", "precompute"])
def test_the_evaluation_samples_the_runs_own_online_reference(paths, tmp_path, monkeypatch, mode):
    """dpo_stage's prepare and finalize share the reference when it stays for the run (`online`): the
    evaluation after the last step samples that one instead of loading a second copy; after `precompute` it
    loads the reference again."""
    from types import SimpleNamespace

    from megatron_rlhf.trainer.dpo import eval as dpo_eval
    from megatron_rlhf.trainer.dpo import fit

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    cfg = C.load_config(C.DPOConfig, None, paths + [f"dpo.eval_prompts_path={prompts}", "data.max_prompt_len=64",
                                                    f"dpo.reference_logprobs={mode}", "tokenizer.allow_swap=true"])
    built, sampled = [], []  # each reference build_reference made, each reference the evaluation sampled with
    monkeypatch.setattr(fit, "build_reference",
                        lambda cfg, tokenizer: built.append([torch.nn.Linear(1, 1)]) or built[-1])
    monkeypatch.setattr(fit, "precompute_table", lambda *a: torch.zeros(0, 2))
    monkeypatch.setattr(dpo_eval.D, "load_examples", lambda *a, **k: ({"prompt_ids": [[1, 2]]}, None))
    monkeypatch.setattr(dpo_eval, "sample_and_score",
                        lambda policy, reference, *a: sampled.append(reference) or {"response_length": 1.0})
    stage = fit.dpo_stage(cfg)
    ctx = SimpleNamespace(model_cfg=SimpleNamespace(vocab_size=17), log=None, tokenizer=None)
    stage.prepare(cfg, ctx, SimpleNamespace(train=[], eval=None), None)
    out = stage.finalize(cfg, [torch.nn.Linear(1, 1)], None, 0, 1, None)
    assert "summary" in out and len(sampled) == 4  # (sft, dpo) x (sampled, greedy)
    assert len(built) == (1 if mode == "online" else 2)  # precompute freed the first: built again
    assert all(r is built[-1] for r in sampled)
