"""The Megatron sampler's greedy continuation of the real model (TP=1 x DP=2: each rank decodes all rows).

Usage: torchrun --nproc_per_node 2 real_model_greedy.py MEGATRON_DIR PROMPTS.pt OUT.json
PROMPTS.pt: {"ids": [b, s] left-padded, "mask": [b, s] bool, "eos": id, "pad": id, "new": tokens}.
Rank 0 writes {"tokens": [[...] per row, up to and including EOS]}.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint import hf as ckpt_hf
from megatron_rlhf.models.build import build_model
from megatron_rlhf.parallel.init import destroy, initialize
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine


def main():
    ckpt, prompts, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]
    par = ParallelConfig()
    initialize(par, seed=0)
    cfg = ckpt_hf.ConvertMeta.read(ckpt).config()
    chunks = build_model(cfg, par, head="lm")
    for c in chunks:
        c.eval()
    ckpt_hf.load_megatron_into_model(chunks, ckpt)
    engine = MegatronRolloutEngine(chunks, eos_id=prompts["eos"], pad_id=prompts["pad"], vocab_size=cfg.vocab_size)
    res = engine.generate(prompts["ids"], prompts["mask"], SamplingParams(prompts["new"], greedy=True))
    rows = [ids[: int(n)].tolist() for ids, n in zip(res["response_ids"], res["lengths"])]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"tokens": rows, "ended": res["ended"].tolist()}, f)
    destroy()


if __name__ == "__main__":
    main()
