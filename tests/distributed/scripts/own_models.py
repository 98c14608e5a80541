"""Models of their own size and tokenizer (issue 45), for tests/distributed/test_reward_models.py.

Usage:
    own_models.py make DIR REWARD_TOKENIZER     (1 rank) random checkpoints in DIR: policy/ (the tiny task's
        tokenizer, 4 layers x hidden 64), reward/ (REWARD_TOKENIZER's vocabulary, 3 layers x hidden 96, 6 heads,
        3 key/value heads: a shape that divides no TP or PP of 2), value/ (the policy's tokenizer, 2 layers x
        hidden 48); each with its model_config.json and the fingerprint of its tokenizer.
    own_models.py score DIR REWARD_TOKENIZER SAMPLES OUT [BATCH [packed]]   (1 rank) the reward model scoring each
        sample of a samples.jsonl directly: its prompt and response text rendered by the preference loader (the
        response's trailing <eos> is the end of a finished answer), at TP=1 -> OUT (JSON: scores, ended). Without
        BATCH one row at a time; with BATCH the rows of each evaluation (one iteration's samples) run BATCH rows at a
        time, each micro-batch right-padded to its widest, as the reward model's inference layout batches them
        (trainer/ppo/inference_layout.py: the iteration's rows in order, split over its DP ranks in blocks that
        are whole micro-batches here); `packed`: each micro-batch packed where the run packs it.
"""

import json
import sys
from pathlib import Path

import torch

from megatron_rlhf.checkpoint import state as ckpt
from megatron_rlhf.config import model_file
from megatron_rlhf.config.schema import DataConfig
from megatron_rlhf.data import dataset as D
from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.models import packing
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.tasks import sort_digits
from megatron_rlhf.trainer.step import model_forward

POLICY = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
              vocab_size=17, max_position_embeddings=32)
REWARD = dict(num_layers=3, hidden_size=96, ffn_hidden_size=192, num_attention_heads=6, num_query_groups=3,
              max_position_embeddings=64)
VALUE = dict(num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             vocab_size=17, max_position_embeddings=32)
EOS_TEXT = "<eos>"  # the tiny tokenizer's EOS as the eval's samples write it (decoded with special tokens)


def reward_arch(reward_tok) -> ModelConfig:
    return ModelConfig(**REWARD, vocab_size=len(reward_tok), init_method_std=0.2)


def make(d: Path, reward_tokenizer: str) -> None:
    sort_digits.save_tokenizer(str(d / "tokenizer"))
    policy_tok, reward_tok = T.load_tokenizer(str(d / "tokenizer")), T.load_tokenizer(reward_tokenizer)
    for seed, (name, arch, head, source, tok) in enumerate([
            ("policy", ModelConfig(**POLICY, init_method_std=0.2), "lm", "policy", policy_tok),
            ("reward", reward_arch(reward_tok), "scalar", "reward", reward_tok),
            ("value", ModelConfig(**VALUE, init_method_std=0.2), "scalar", "reward", policy_tok)]):
        torch.manual_seed(10 + seed)
        chunks = build_model(arch, ParallelConfig(), head=head)
        if head == "scalar":  # a zero head would score every row alike
            torch.nn.init.normal_(chunks[0].output_layer.weight, std=0.5)
        stage = "sft" if name == "policy" else "rm"
        ckpt.save_checkpoint(d / name, 1, {source: chunks}, {}, {}, {"step": 1},
                             run=ckpt.RunRecord.new(stage, T.fingerprint(tok)))
        model_file.write_model_config(arch, str(d / name))


@torch.no_grad()
def score(d: Path, reward_tokenizer: str, samples: Path, out: Path, batch=None, packed=False) -> None:
    reward_tok = T.load_tokenizer(reward_tokenizer)
    [model] = ckpt.load_model(d / "reward", reward_arch(reward_tok), ParallelConfig(), "reward", "scalar")
    model.eval()
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    data = DataConfig(max_seq_len=64)
    sequences = []
    for r in rows:
        ended = r["response"].endswith(EOS_TEXT)
        text = r["response"][: -len(EOS_TEXT)].rstrip(" ") if ended else r["response"]
        if ended:  # as stage 2 read its pairs
            pair = {"prompt": r["prompt"], "chosen": text, "rejected": text + " 7"}
            path = out.parent / "pair.jsonl"
            path.write_text(json.dumps(pair) + "\n")
            ids = D.load_examples("preference", data, reward_tok, str(path), log=None)[0][0]["chosen_ids"]
        else:  # a response cut at the length limit: no end of turn, no EOS
            ids = reward_tok(r["prompt"])["input_ids"] + reward_tok(text, add_special_tokens=False)["input_ids"]
        sequences.append(ids)
    if batch is None:
        scores = [float(model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), None)[0, -1, 0])
                  for ids in sequences]
    else:
        scores, packed_microbatches = [], 0
        for it in sorted({r["iteration"] for r in rows}):
            mine = [ids for ids, r in zip(sequences, rows) if r["iteration"] == it]
            for s in range(0, len(mine), batch):
                part = mine[s: s + batch]
                x = torch.zeros(len(part), max(len(ids) for ids in part), dtype=torch.long)
                for i, ids in enumerate(part):
                    x[i, : len(ids)] = torch.tensor(ids)
                mb = {"input_ids": x, "lengths": torch.tensor([len(ids) for ids in part])}
                pack_width = packing.packed_width(mb["lengths"], 1)
                if packed and packing.worth_packing(mb["input_ids"].numel(), pack_width):  # as the run packs
                    mb["pack_width"] = pack_width
                    packed_microbatches += 1
                output = model_forward(model, mb)[:, :, 0]
                scores += [float(output[i, len(mine[s + i]) - 1]) for i in range(len(mb["input_ids"]))]
    out.write_text(json.dumps({"scores": scores, "ended": [r["response"].endswith(EOS_TEXT) for r in rows],
                               "packed_microbatches": packed_microbatches if batch else 0}))


def main():
    mode, d, reward_tokenizer = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    init.initialize(ParallelConfig(), seed=1)
    if mode == "make":
        make(d, reward_tokenizer)
    else:
        score(d, reward_tokenizer, Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]) if len(sys.argv) > 6 else None,
              len(sys.argv) > 7 and sys.argv[7] == "packed")
    init.destroy()


if __name__ == "__main__":
    main()
