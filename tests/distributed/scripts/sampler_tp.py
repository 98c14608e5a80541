"""The megatron sampler at TP=2 picks the same tokens as at TP=1 with the same weights.

Usage: torchrun --nproc_per_node 2 sampler_tp.py OUT.json CKPT_DIR
Phase 1 (tp=1, i.e. dp=2): build a tiny LM, generate (greedy and seeded sampling) on a fixed
left-padded batch, save the weights with dist_checkpointing. Phase 2 (tp=2): build the model again,
load the weights resharded, generate again, and again through Megatron's own forward (path="module";
the default is the lean forward of rollout/lean_decode.py). At both sizes the lean forward's logits are
compared with Megatron's at prefill and every decode step. The vocabulary (61 ids, padded to 62, 64 at
TP=2) leaves padded ids, in rank 1's shard at TP=2. Rank 0 writes both ranks' results.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.lean_decode import LeanDecoder
from megatron_rlhf.rollout.megatron_engine import ModuleDecoder, decode_path, generate

VOCAB, PAD, EOS = 61, 0, 7
CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=64, init_method_std=0.2, make_vocab_size_divisible_by=2)
CASES = {  # name -> sampling settings
    "greedy": dict(greedy=True),
    "sample_t1": dict(temperature=1.0, seed=21),
    "sample_t07": dict(temperature=0.7, seed=22),
}


def prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 8, 1, 6, 3]
    s = max(lengths) + 1
    ids = torch.full((len(lengths), s), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, s - n :] = torch.randint(1, VOCAB, (n,), generator=g)
    return ids, torch.tensor(lengths)


def run_cases(model, path="auto"):
    ids, lengths = prompts()
    out = {}
    for name, kw in CASES.items():
        r = generate(model, ids, prompt_lengths=lengths, max_new_tokens=12, eos_id=EOS, pad_id=PAD,
                     vocab_size=VOCAB, path=path, **kw)
        out[name] = {k: v.tolist() for k, v in r.items()}
    return out


@torch.no_grad()
def lean_gap(model, tp, b=3, prefill=4, steps=5):
    """max |lean - Megatron| next-token logits [b, V_padded] over the prefill and each decode step."""
    g = torch.Generator().manual_seed(1)
    width = prefill + steps + 1
    seq = torch.randint(0, VOCAB, (b, width), generator=g)
    pos = torch.arange(width).expand(b, -1)
    model.eval()
    ref, lean = ModuleDecoder(model, b, width), LeanDecoder(model, b, width)
    gaps = [(ref.prefill(seq[:, :prefill], pos[:, :prefill]) - lean.prefill(seq[:, :prefill], pos[:, :prefill])).abs().max()]
    for t in range(prefill, prefill + steps):
        a, c = ref.step(seq[:, t:t + 1], pos[:, t:t + 1]), lean.step(seq[:, t:t + 1], pos[:, t:t + 1])
        assert a.shape == c.shape == (b, CFG.padded_vocab_size(tp)), (a.shape, c.shape)  # gathered over TP
        gaps.append((a - c).abs().max())
    return max(float(x) for x in gaps)


def phase(tp, ckpt_dir, mode):
    from megatron.core import dist_checkpointing

    parallel = ParallelConfig(tp=tp)
    init.initialize(parallel, seed=5)
    torch.manual_seed(5)
    (model,) = build_model(CFG, parallel)
    state = model.sharded_state_dict(prefix="")
    if mode == "save":
        dist_checkpointing.save(state, ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(state, ckpt_dir))
    out = {"cases": run_cases(model), "lean_gap": lean_gap(model, tp), "path": decode_path(model)}
    if mode == "load":  # TP=2: the same cases through Megatron's forward
        out["module_cases"] = run_cases(model, path="module")
    return out


def main(out_path, ckpt_dir):
    os.makedirs(ckpt_dir, exist_ok=True)
    tp1 = phase(1, ckpt_dir, "save")
    dist.barrier()
    tp2 = phase(2, ckpt_dir, "load")
    result = {"tp1": tp1["cases"], "tp2": tp2["cases"], "tp2_module": tp2["module_cases"],
              "lean_gap": {"tp1": tp1["lean_gap"], "tp2": tp2["lean_gap"]}, "path": {"tp1": tp1["path"], "tp2": tp2["path"]}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    init.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
