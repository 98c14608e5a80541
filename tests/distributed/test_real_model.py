"""The real pretrained SmolLM2-135M-Instruct (GGUF from the registry, megatron_rlhf/checkpoint/fetch.py) on 2 gloo ranks:
converted with `--gguf`, its Megatron logits on chat-rendered prompts equal transformers' within 1e-4 (fp32)
at TP=1 x DP=2 and at PP=2, loaded from the converted checkpoint and straight from the HF tensors, and
its weights stream back out bit for bit (scripts/convert_parity.py, the same checks as the tiny models);
the Megatron sampler's greedy continuation equals transformers' `generate` for 32 tokens on 4
left-padded chat prompts (scripts/real_model_greedy.py); two PPO iterations on it (chat prompts, its
tokenizer and EOS, the distributed optimizer) stop after the first, resume, and export an HF policy that
transformers loads and chats with."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.checkpoint.convert_cli import hf_to_megatron_main
from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR
from megatron_rlhf.trainer.metrics import read_jsonl
from tests.distributed.launch import CLI, read_json, torchrun

TOL = 1e-4
QUESTIONS = ("Sort these digits in ascending order: 7 3 9 1", "What is the capital of France?",
             "Write one sentence about the sea.", "List three prime numbers.")


def _chat_ids(tok, question):
    """The token ids of one user turn rendered with the model's chat template and the generation prompt."""
    out = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def work(smollm2):
    """smollm2.mg (converted from the GGUF) and smollm2/ (its HF export), from the session fixture, plus
    smollm2.ref.pt: transformers' logits on chat-rendered prompts, as scripts/convert_parity.py reads them."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    w = smollm2["dir"]
    tok = AutoTokenizer.from_pretrained(w / "smollm2.mg" / TOKENIZER_DIR)
    rows = [_chat_ids(tok, q) for q in QUESTIONS]
    width = min(len(r) for r in rows)  # same length, no padding: every position is a real token
    tokens = torch.tensor([r[:width] for r in rows])
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(w / "smollm2", dtype=torch.float32)(input_ids=tokens).logits
    torch.save({"tokens": tokens, "logits": logits.float()}, w / "smollm2.ref.pt")
    return w


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_real_model_logits_match_transformers(work, layout):
    out = work / f"{layout}.json"
    torchrun("convert_parity.py", layout, str(work), str(out), "smollm2", nproc=2)
    r = read_json(out)["smollm2"]
    assert r["ckpt_max_diff"] <= TOL, r
    assert r["hf_direct_max_diff"] <= TOL, r
    assert r["stream_names_equal"] and r["stream_shapes_equal"] and r["stream_mismatched"] == [], r


def test_real_model_greedy_continuation_matches_generate(work):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(work / "smollm2.mg" / TOKENIZER_DIR)
    rows = [_chat_ids(tok, q) for q in QUESTIONS]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):  # left padding, rows of different lengths
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = True
    new = 32
    torch.save({"ids": ids, "mask": mask, "eos": tok.eos_token_id, "pad": tok.pad_token_id, "new": new},
               work / "greedy_prompts.pt")
    torchrun("real_model_greedy.py", str(work / "smollm2.mg"), str(work / "greedy_prompts.pt"),
             str(work / "greedy.json"), nproc=2)
    ours = read_json(work / "greedy.json")["tokens"]
    model = LlamaForCausalLM.from_pretrained(work / "smollm2", dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, width:]
    theirs = []
    for row in out.tolist():  # up to and including the first EOS, as the sampler reports it
        theirs.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    assert [len(r) for r in ours] == [len(r) for r in theirs]
    assert ours == theirs
    lengths = sorted(len(r) for r in ours)
    assert lengths[0] >= 4 and lengths[-1] == new, lengths  # real answers, one still going at 32 tokens


def test_two_ppo_iterations_on_the_real_model_resume_and_export(work, tmp_path):
    import json

    from transformers import AutoTokenizer, LlamaForCausalLM

    assert hf_to_megatron_main(["--hf-dir", str(work / "smollm2"), "--out", str(tmp_path / "rm.mg"), "--head",
                                "scalar", "--quiet"]) == 0  # a reward model seeded from the policy (zero head)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Sort these digits: {i} 3 1"}]})
                               + "\n" for i in range(16)))
    run = tmp_path / "ppo"
    args = ["ppo", f"model.load={work / 'smollm2.mg'}", f"tokenizer.path={work / 'smollm2.mg' / TOKENIZER_DIR}",
            f"data.train_path={prompts}", "data.max_seq_len=64", "data.max_prompt_len=48", "train.lr=1e-6",
            "train.lr_schedule=constant", "train.micro_batch_size=2", f"ppo.reward_load={tmp_path / 'rm.mg'}",
            "ppo.normalize_reward=false", "ppo.iterations=2", "ppo.rollout_batch_size=4", "ppo.minibatch_size=4",
            "ppo.epochs=1", "ppo.max_new_tokens=8", "ppo.eval_interval=0", "checkpoint.save_interval=1",
            f"logging.run_dir={run}", "logging.progress_bar=false",
            "parallel.use_distributed_optimizer=true"]  # as the 8B and 70B recipes: each rank saves its shard
    first = torchrun(CLI, *args, "train.exit_at_step=1", nproc=2, timeout=900)
    assert not (run / "hf_policy").exists() and (run / "checkpoints" / "latest").read_text().strip().endswith("1")
    resumed = torchrun(CLI, *args, nproc=2, timeout=900)
    assert "resumed from" in resumed.stdout + resumed.stderr
    # 4 GB each (policy and value with their Adam moments): the interval's save is not repeated at the end
    assert first.stdout.count("checkpoint of iteration 1:") == 1 and resumed.stdout.count("checkpoint of") == 1
    steps = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "ppo/kl_per_seq" in r}
    assert sorted(steps) == [1, 2]
    assert steps[1]["ppo/kl_per_seq"] == 0.0 and steps[1]["ppo/ratio_first_minibatch"] == 1.0  # policy == reference
    assert abs(steps[1]["ppo/rho_mean"] - 1) < 1e-3  # the sampler and the trainer agree on the real model

    tok = AutoTokenizer.from_pretrained(run / "hf_policy")
    model = LlamaForCausalLM.from_pretrained(run / "hf_policy", dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[1]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert tok.eos_token == "<|im_end|>" and len(answer.split()) >= 3, answer
