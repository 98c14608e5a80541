"""Packed against padded micro-batches on a long-tailed mix of response lengths: the PPO iteration's phases.

    python benchmarks/packing.py                          # reference shape, ~3 minutes
    python benchmarks/packing.py --shape smollm2-135m     # SmolLM2-135M (random weights), ~20 minutes
    ... [--repeats N] [--max-len L]

The mix: 16 prompts of 8-16 random tokens; response lengths log-normal (median 32 tokens, sigma 1.0; --sigma) clipped
to [8, L] (L = 1024 at the reference shape, 256 at SmolLM2's, where a padded pass over 1024-token rows takes
minutes on 2 CPU threads); one draw per iteration, the same for both sides. Fixed: every response 64 tokens
(the reference shape's fixed-length case, where packing has nothing to remove: it must not be slower).

An iteration here is the phases after the rollout, exactly as `trainer/ppo/fit.py` runs them: score
(score_and_recompute: reward, policy, reference and value forwards), advantages, learn (policy and value
optimizer steps, 2 minibatches x 4 epochs). The rollout is left out: its tokens are drawn, not sampled, and the
sampler does not pack (its cost is the same either way). Padded: train.packing=false (micro_batch_size rows
padded to the longest); packed: the default (rows end to end, token-budget micro-batches of micro_batch_size x
the longest row's tokens). The two alternate iteration by iteration on the same four models (the VM's drift
slows both alike); the speed-up is the ratio of their medians.

real_token_fraction: real tokens / tokens the model processed, over every forward of the iteration (the policy
and value training forwards and the four scoring forwards), as a run logs it (perf/real_token_fraction). One JSON line at the end (machine.py's CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ppo_iteration as bench  # noqa: E402  (benchmarks/ is on sys.path when this file runs as a script)
from machine import cpu, gpu, sync  # noqa: E402
from shapes import PROMPTS  # noqa: E402

MIXES = ("long_tailed", "fixed")


def response_lengths(mix: str, it: int, max_len: int, sigma: float = 1.0) -> torch.Tensor:
    """[PROMPTS] response lengths of iteration `it` of `mix`."""
    if mix == "fixed":
        return torch.full((PROMPTS,), 64, dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + it)
    drawn = torch.exp(torch.log(torch.tensor(32.0)) + sigma * torch.randn(PROMPTS, generator=g))
    return drawn.round().long().clamp(8, max_len)


def experience(lengths: torch.Tensor, vocab: int, it: int):
    from megatron_rlhf.trainer.ppo.batch import build_experience

    g = torch.Generator().manual_seed(it)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in torch.randint(8, 17, (PROMPTS,), generator=g)]
    T = int(lengths.max())
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    ids = (torch.randint(1, vocab, (PROMPTS, T), generator=g) * mask).long()
    gen = {"response_ids": ids, "response_mask": mask, "logprobs": torch.zeros(PROMPTS, T),
           "ended": torch.ones(PROMPTS, dtype=torch.bool), "lengths": lengths}
    return build_experience(prompts, gen, 0)


def one(ours, packed: bool, mix: str, it: int, max_len: int, sigma: float = 1.0) -> dict:
    from megatron_rlhf.models import packing
    from megatron_rlhf.trainer.ppo.experience import Frozen, estimate_advantages, score_and_recompute
    from megatron_rlhf.trainer.ppo.learn import SkipGuard, learn

    packing.configure(packed)
    exp = experience(response_lengths(mix, it, max_len, sigma), ours.cfg.vocab_size, it)
    packing.take_real_token_fraction()  # the tally of this iteration starts here
    sync()
    marks = [time.perf_counter()]
    score_and_recompute(exp, ours.models, Frozen(ours.cfg.vocab_size, 1.0), ours.cfg.train.micro_batch_size)
    sync()
    marks.append(time.perf_counter())
    estimate_advantages(exp, 0.05, "k1", 1.0, 0.95, True)
    marks.append(time.perf_counter())
    learn(ours.policy, ours.value, exp, ours.cfg, iteration=it, dp_rank=0, dp_size=1, vocab_size=ours.cfg.vocab_size,
          train_policy=True, guard=SkipGuard(3), steps_done={"policy": 0, "value": 0})
    sync()
    marks.append(time.perf_counter())
    phases = {name: b - a for name, a, b in zip(("score", "advantages", "learn"), marks, marks[1:])}
    return {"s": marks[-1] - marks[0], **phases, "real_token_fraction": packing.take_real_token_fraction()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="reference")
    parser.add_argument("--repeats", type=int, default=0, help="iterations per side and mix (default 5; SmolLM2: 2)")
    parser.add_argument("--max-len", type=int, default=0, help="longest response (default 1024; SmolLM2: 256)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the response lengths")
    args = parser.parse_args()
    reference = args.shape == "reference"
    repeats = args.repeats or (5 if reference else 2)
    max_len = args.max_len or (1024 if reference else 256)
    shape = dict(bench.SHAPES[args.shape], max_position_embeddings=max(2048, max_len + 32))
    model_cfg, parallel = bench.setup(shape, "float32")
    cfg, policy, value, models = bench.build(model_cfg, parallel, 64)
    ours = argparse.Namespace(cfg=cfg, policy=policy, value=value, models=models)
    mixes = MIXES if reference else ("long_tailed",)
    results = {}
    for mix in mixes:
        for packed in (False, True):  # a warm-up of each side
            one(ours, packed, mix, -1, max_len, args.sigma)
        runs = {False: [], True: []}
        for it in range(repeats):
            for packed in (False, True):
                r = one(ours, packed, mix, it, max_len, args.sigma)
                runs[packed].append(r)
                print(f"  {mix} {'packed' if packed else 'padded'} {it + 1}: {r['s']:.2f} s "
                      f"(score {r['score']:.2f}, learn {r['learn']:.2f}; real tokens {r['real_token_fraction']:.2f})",
                      flush=True)
        side = {}
        for packed, name in ((False, "padded"), (True, "packed")):
            rs = runs[packed]
            side[name] = {k: round(statistics.median(r[k] for r in rs), 4)
                          for k in ("s", "score", "advantages", "learn", "real_token_fraction")}
        side["speedup"] = round(side["padded"]["s"] / side["packed"]["s"], 3)
        side["each"] = [{"padded_real_token_fraction": round(a["real_token_fraction"], 3),
                         "speedup": round(a["s"] / b["s"], 3)} for a, b in zip(runs[False], runs[True])]
        results[mix] = side
        print(f"{mix}: padded {side['padded']['s']:.2f} s, packed {side['packed']['s']:.2f} s, "
              f"speed-up {side['speedup']:.2f}x; real-token fraction {side['padded']['real_token_fraction']:.2f} -> "
              f"{side['packed']['real_token_fraction']:.2f}", flush=True)
    print(json.dumps({"benchmark": "packing", "shape": args.shape, "dtype": "float32", "prompts": PROMPTS,
                      "response_lengths": f"log-normal median 32 sigma {args.sigma} clipped to [8, {max_len}]; fixed: 64",
                      "iterations_each": {m: r.pop("each") for m, r in results.items()},
                      "repeats": repeats, "cpu": cpu(), "gpu": gpu(), **results}))


if __name__ == "__main__":
    main()
