"""Seconds per PPO iteration at a model shape, the phase split, overhead, kernel floor and TRL side by side.

    python benchmarks/ppo_iteration.py            # reference shape: one process, 2 threads, < 5 minutes
    python benchmarks/ppo_iteration.py --shape smollm2-135m [--dtype bfloat16]   # the realistic shape (~15 min)
    python benchmarks/ppo_iteration.py --shape smollm2-135m --dtype both   # fp32 and bf16 in one process (~25 min)
    ... [--repeats N] [--no-trl] [--profile 25]   # --profile: the top ops of one profiled iteration
    ... [--sampler-logprobs]   # ours also with ppo.old_logprobs=sampler, TRL's way of taking PPO's old log-probs

Each run ends with one JSON line (with the CPU, and GPU if any, it ran on: `machine.py`).

On a machine with CUDA both sides run on its first GPU, as the package does there (Megatron builds on the
current device, NCCL; TRL with `use_cpu=False`): the phase marks and the model clock synchronise the device
first, and the kernel floor is the GPU time of the same GEMM and attention ops (torch.profiler, CUDA activity).

Reference shape (issue "Stage 3, PPO end to end"): Llama hidden 128, 4 layers, 4 heads, 2 query groups,
FFN 352, vocab 512, fp32; per-op overhead dominates there. Realistic shape (--shape smollm2-135m):
SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocab 49152, tied embeddings, random
weights), where the time is in the kernels. Both: 16 prompts of 8-16 random tokens; 64 new tokens (EOS never ends a response);
2 minibatches x 4 epochs; one rank. An iteration is exactly the phases `trainer/ppo/fit.py:fit` runs:
rollout (Megatron KV-cache sampler) -> score_and_recompute (RM, policy, reference, value forwards) ->
estimate_advantages -> learn (policy and value optimizer steps through Megatron's schedule).

overhead_fraction: the share of an iteration spent outside model forward passes (GPTModel.forward, and the
sampler's lean forward `rollout/lean_decode.py` LeanDecoder.prefill / step),
backward passes (torch.autograd.backward) and optimizer steps: sampling, data movement, the schedule,
loss math and everything else of ours. length_scaling_exponent: the log-log slope of iteration time
for 64 -> 128 -> 256 new tokens (1.0 = linear in the response length; reference shape only). kernel_floor_s_per_iter: the
seconds one profiled iteration spends inside GEMM and attention kernels alone (torch.profiler self time of
aten::mm/addmm/bmm and the SDPA kernels): work TRL does too, so `s_per_iter_trl / kernel_floor` bounds
the speed-up any implementation of the same computation on this machine could reach.

The reference library, side by side: when TRL's PPO is importable (`pip install "trl==1.12.0"`; see
`trl_reference.py`), the same shape runs through its PPOTrainer in this process, interleaved with ours (one
iteration of ours after each of TRL's updates, off TRL's clock, so the VM's drift over a run slows both
alike; --blocks: all of ours first, then TRL's), and `speedup_vs_trl` = TRL's median seconds per iteration /
ours. Interleaved, each side also runs in the caches, memory and library state the other leaves, and ours
came out slower that way while TRL did not (reference shape 1.09-1.13 s against 0.96-1.06 s in blocks; bf16
at the SmolLM2 shape 37-44 s against 31.4 s alone; docs/performance.md, runs G-J): the interleaved ratio is
the conservative one for ours. Without it both are null. TRL takes PPO's old log-probs
from its generation pass; ours recomputes them with a policy forward unless `ppo.old_logprobs=sampler`:
--sampler-logprobs times ours that way too (`speedup_vs_trl_sampler_logprobs`). --dtype bfloat16: ours
with bf16 parameters (Megatron's mixed-precision optimizer, fp32 main weights), TRL with `bf16=True`
(accelerate's bf16 autocast over fp32 weights): each library's own bf16 training mode. --dtype both: fp32,
then bf16, each beside TRL's at the same precision, in one process; the JSON line holds one record per
precision and `bf16_speedup_vs_fp32`, ours in fp32 / ours in bf16 (the VM's speed drifts by tens of percent
between runs, so only a ratio measured in one run says anything).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import trl_reference  # noqa: E402  (benchmarks/ is on sys.path when this file runs as a script)

from machine import cpu, gpu, refuse_emulated_dtypes, sync  # noqa: E402

from shapes import EPOCHS, MINIBATCHES, PROMPTS, SHAPE, SMOLLM2_135M, random_prompts  # noqa: E402

SHAPES = {"reference": SHAPE, "smollm2-135m": SMOLLM2_135M}


@dataclass
class Clock:
    """Accumulates seconds spent in model forward, backward and optimizer steps (outermost calls only)."""

    seconds: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0, "optimizer": 0.0})
    depth: int = 0
    enabled: bool = True  # off: calls pass through uncounted (TRL's, the profiled and the warm-up iterations)

    def reset(self):
        self.seconds = {bucket: 0.0 for bucket in self.seconds}
        self.enabled = False

    def wrap(self, owner, name: str, bucket: str):
        inner = getattr(owner, name)
        clock = self

        @functools.wraps(inner)  # megatron inspects forward's signature
        def timed(*args, **kwargs):
            if clock.depth or not clock.enabled:
                return inner(*args, **kwargs)
            clock.depth += 1
            sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                clock.seconds[bucket] += time.perf_counter() - start
                clock.depth -= 1

        setattr(owner, name, timed)


def setup(shape: dict, dtype: str):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free one: a fixed port may be taken by another run
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(2)
    from megatron_rlhf.models.spec import ModelConfig
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig

    parallel = ParallelConfig()
    if not torch.distributed.is_initialized():  # --dtype both: the second precision reuses the world
        init.initialize(parallel, seed=0)
    from megatron_rlhf.models import packing

    packing.configure(True)  # as a run with train.packing's default (trainer/run.py configure_packing)
    return ModelConfig(**shape, params_dtype=dtype), parallel


def build(model_cfg, parallel, max_new_tokens: int, old_logprobs: str = "recompute"):
    from megatron_rlhf.config.schema import TrainConfig
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.config.ppo import PPOSection
    from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
    from megatron_rlhf.trainer.run import Trainable

    def trainable(head):
        chunks = wrap_ddp(build_model(model_cfg, parallel, head=head), False, check_for_nan_in_grad=False)
        opt, sched = build_optimizer(chunks, TrainConfig(lr=1e-5, lr_schedule="constant"), False, 10_000)
        return Trainable(chunks, opt, sched)

    policy, value = trainable("lm"), trainable("scalar")
    reference, reward = build_model(model_cfg, parallel, head="lm"), build_model(model_cfg, parallel, head="scalar")
    ppo = PPOSection(rollout_batch_size=PROMPTS, minibatch_size=PROMPTS // MINIBATCHES, epochs=EPOCHS,
                     max_new_tokens=max_new_tokens, old_logprobs=old_logprobs)
    cfg = SimpleNamespace(ppo=ppo, train=SimpleNamespace(seed=0, micro_batch_size=PROMPTS // MINIBATCHES,
                                                         max_tokens_per_micro_batch=None),
                          vocab_size=model_cfg.vocab_size)
    return cfg, policy, value, {"policy": policy.chunks, "value": value.chunks, "reference": reference, "reward": reward}


def iteration(cfg, engine, policy, value, models, prompts, it: int, timer: dict):
    from megatron_rlhf.trainer.ppo.batch import build_experience
    from megatron_rlhf.rollout.base import SamplingParams
    from megatron_rlhf.trainer.ppo.experience import Frozen, estimate_advantages, score_and_recompute
    from megatron_rlhf.trainer.ppo.eval import uniforms
    from megatron_rlhf.trainer.ppo.learn import SkipGuard, learn

    p = cfg.ppo
    sync()
    marks = [time.perf_counter()]
    draws = uniforms(0, it, slice(0, PROMPTS), PROMPTS, p.max_new_tokens)
    ids, mask = prompts
    out = engine.generate(ids, mask, SamplingParams(p.max_new_tokens, 1.0), uniforms=draws)
    rows = [ids[i][mask[i]].tolist() for i in range(PROMPTS)]
    exp = build_experience(rows, out, 0)
    sync()
    marks.append(time.perf_counter())
    score_and_recompute(exp, models, Frozen(cfg.vocab_size, 1.0), cfg.train.micro_batch_size,
                        old_logprobs=p.old_logprobs)
    sync()
    marks.append(time.perf_counter())
    estimate_advantages(exp, 0.05, "k1", 1.0, 0.95, True)
    sync()
    marks.append(time.perf_counter())
    learn(policy, value, exp, cfg, iteration=it, dp_rank=0, dp_size=1, vocab_size=cfg.vocab_size,
          train_policy=True, guard=SkipGuard(3), steps_done={"policy": 0, "value": 0})
    sync()
    marks.append(time.perf_counter())
    for name, a, b in zip(("rollout", "score", "advantages", "train"), marks, marks[1:]):
        timer[name] = timer.get(name, 0.0) + b - a
    return marks[-1] - marks[0]


KERNELS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
# The same work on CUDA: torch's SDPA picks one of these backends (forward and backward).
CUDA_ATTENTION = tuple(f"aten::_scaled_dot_product_{kind}_attention{suffix}" for kind in ("flash", "efficient", "cudnn")
                       for suffix in ("", "_backward"))


def kernel_seconds(run, top: int = 0) -> float:
    """Seconds of `run()` spent inside GEMM and attention kernels (torch.profiler self time: CPU time, or on
    CUDA the GPU time of the kernels those ops launch); `top` > 0 also prints that many ops with the most."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        run()
        sync()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    if top:
        print(prof.key_averages().table(sort_by=key, row_limit=top), flush=True)
    names = KERNELS + CUDA_ATTENTION if on_gpu else KERNELS
    return sum(getattr(e, key) for e in prof.key_averages() if e.key in names) / 1e6


def prepare(model_cfg, parallel, max_new_tokens: int) -> SimpleNamespace:
    """Ours at one shape (four models, the sampler, the prompts), after one warm-up iteration."""
    from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

    cfg, policy, value, models = build(model_cfg, parallel, max_new_tokens)
    engine = MegatronRolloutEngine(policy.chunks, eos_id=None, pad_id=0, vocab_size=model_cfg.vocab_size)
    ours = SimpleNamespace(cfg=cfg, engine=engine, policy=policy, value=value, models=models, prompts=random_prompts(),
                           count=0)
    timed_iteration(ours, {})
    return ours


def timed_iteration(ours: SimpleNamespace, timer: dict, old_logprobs: str = "recompute") -> float:
    """One more iteration of `ours` (each draws its own samples); its seconds, its phases added to `timer`."""
    ours.cfg.ppo.old_logprobs = old_logprobs
    seconds = iteration(ours.cfg, ours.engine, ours.policy, ours.value, ours.models, ours.prompts, ours.count, timer)
    ours.count += 1
    return seconds


def measure(model_cfg, parallel, max_new_tokens: int, repeats: int) -> float:
    """Median seconds per iteration of ours alone (the length sweep)."""
    ours = prepare(model_cfg, parallel, max_new_tokens)
    return statistics.median(timed_iteration(ours, {}) for _ in range(repeats))


def run(args, dtype: str, clock: Clock) -> dict:
    """Ours (and TRL's, unless --no-trl) at one precision: prints the figures, returns the JSON fields.

    With TRL, ours runs one iteration after each of TRL's updates, in TRL's callback and off TRL's clock: the
    two alternate, so the VM's drift over the minutes of a run (tens of percent) slows both alike."""
    reference = args.shape == "reference"
    repeats = args.repeats or (5 if reference else 2)
    shape = SHAPES[args.shape]
    model_cfg, parallel = setup(shape, dtype)
    ours = prepare(model_cfg, parallel, 64)
    modes = ("recompute", "sampler") if args.sampler_logprobs else ("recompute",)
    times, timers = {m: [] for m in modes}, {m: {} for m in modes}
    clock.reset()

    def ours_round():
        for mode in modes:
            if len(times[mode]) < repeats:
                clock.enabled = mode == "recompute"  # the model-time split is of the default mode
                times[mode].append(timed_iteration(ours, timers[mode], mode))
                clock.enabled = False
                print(f"  ours ({mode}), iteration {len(times[mode])}: {times[mode][-1]:.3f} s", flush=True)

    trl_s = None
    if args.no_trl or not trl_reference.available():
        print("TRL's side skipped (--no-trl)" if args.no_trl else
              "TRL's PPO is not importable here (pip install 'trl==1.12.0'): no side-by-side reference figure")
        for _ in range(repeats):
            ours_round()
    else:
        if args.blocks:  # all of ours first, then all of TRL's (runs A-F of docs/performance.md)
            for _ in range(repeats):
                ours_round()
        ids, mask = random_prompts()
        rows = [ids[i][mask[i]].tolist() for i in range(PROMPTS)]
        trl_s, trl_times = trl_reference.seconds_per_iteration(shape, PROMPTS, MINIBATCHES, EPOCHS, 64, repeats, rows,
                                                               bf16=dtype == "bfloat16",
                                                               between=None if args.blocks else ours_round)
    s_per_iter, phases = statistics.median(times["recompute"]), {k: v / repeats for k, v in timers["recompute"].items()}
    model_seconds = {k: v / repeats for k, v in clock.seconds.items()}
    overhead = 1.0 - sum(clock.seconds.values()) / sum(times["recompute"])
    # After the timed iterations (the profiler must not slow those), off the clock.
    floor = kernel_seconds(lambda: timed_iteration(ours, {}), args.profile)
    del ours
    scaling, slope = {64: s_per_iter}, None
    if reference:  # at the realistic shape one iteration takes about a minute: no length sweep there
        for n in (128, 256):
            scaling[n] = measure(model_cfg, parallel, n, repeats=2)
        xs, ys = [math.log(n) for n in scaling], [math.log(t) for t in scaling.values()]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"{args.shape} shape, {dtype}: {s_per_iter:.3f} s/iteration; "
          f"phases {', '.join(f'{k} {v:.3f}s' for k, v in phases.items())}")
    print(f"inside model forward/backward/optimizer: {', '.join(f'{k} {v:.3f}s' for k, v in model_seconds.items())} "
          f"per iteration; overhead fraction {overhead:.3f}; GEMM + attention kernels alone {floor:.3f}s "
          f"({floor / s_per_iter:.0%} of the iteration)")
    sampler_s = statistics.median(times["sampler"]) if "sampler" in times else None
    if sampler_s is not None:
        print(f"ours with ppo.old_logprobs=sampler: {sampler_s:.3f} s/iteration")
    if trl_s is not None:
        print(f"TRL PPOTrainer, same shape, {dtype}: {trl_s:.3f} s/iteration ({', '.join(f'{t:.3f}' for t in trl_times)}); "
              f"ours is {trl_s / s_per_iter:.2f}x faster; the kernels alone bound it at {trl_s / floor:.2f}x")
        if sampler_s is not None:
            print(f"with the old log-probs from the sampler (TRL's way) ours is {trl_s / sampler_s:.2f}x faster")
    if reference:
        print(f"new tokens -> s/iteration: {', '.join(f'{n}: {t:.3f}' for n, t in scaling.items())}; exponent {slope:.3f}")
    return {
        "dtype": dtype,
        "s_per_iter": round(s_per_iter, 4),
        "s_per_iter_each": [round(t, 4) for t in times["recompute"]],
        "phase_seconds": {k: round(v, 4) for k, v in phases.items()},
        "model_seconds_per_iter": {k: round(v, 4) for k, v in model_seconds.items()},
        "overhead_fraction": round(overhead, 4),
        "s_per_iter_by_new_tokens": {str(n): round(t, 4) for n, t in scaling.items()},
        "length_scaling_exponent": None if slope is None else round(slope, 4),
        "s_per_iter_trl": None if trl_s is None else round(trl_s, 4),
        "s_per_iter_trl_each": None if trl_s is None else [round(t, 4) for t in trl_times],
        "speedup_vs_trl": None if trl_s is None else round(trl_s / s_per_iter, 3),
        "s_per_iter_sampler_logprobs": None if sampler_s is None else round(sampler_s, 4),
        "speedup_vs_trl_sampler_logprobs": None if trl_s is None or sampler_s is None else round(trl_s / sampler_s, 3),
        "kernel_floor_s_per_iter": round(floor, 4),
        "kernel_fraction": round(floor / s_per_iter, 4),
        "speedup_bound_vs_trl": None if trl_s is None else round(trl_s / floor, 3),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="reference", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "both"),
                        help="both: fp32 then bf16 in this process, each beside TRL's, and ours bf16 against ours fp32")
    parser.add_argument("--repeats", type=int, default=None, help="timed iterations (default 5; 2 at smollm2-135m)")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's side")
    parser.add_argument("--blocks", action="store_true",
                        help="time all of ours, then all of TRL's, instead of interleaving them (each side then runs "
                             "alone, but minutes apart: the VM's drift enters the ratio)")
    parser.add_argument("--sampler-logprobs", action="store_true",
                        help="also time ours with ppo.old_logprobs=sampler (no policy forward for the old log-probs, "
                             "as TRL's PPOTrainer takes them from generation)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N ops with most self time")
    args = parser.parse_args()
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    refuse_emulated_dtypes(parser, dtypes)
    from megatron.core.models.gpt import GPTModel

    from megatron_rlhf.rollout.lean_decode import LeanDecoder
    from megatron_rlhf.trainer import optim

    clock = Clock()
    clock.wrap(GPTModel, "forward", "forward")
    for name in ("prefill", "step"):  # the sampler's forward when it does not go through GPTModel.forward
        clock.wrap(LeanDecoder, name, "forward")
    clock.wrap(torch.autograd, "backward", "backward")
    clock.wrap(optim, "optimizer_step", "optimizer")
    results = {dtype: run(args, dtype, clock) for dtype in dtypes}
    line = {"shape": args.shape, **results[dtypes[0]]} if len(dtypes) == 1 else {"shape": args.shape, **results}
    if len(dtypes) == 2:
        ratio = results["float32"]["s_per_iter"] / results["bfloat16"]["s_per_iter"]
        print(f"ours in bf16 is {ratio:.2f}x ours in fp32, measured in this process")
        line["bf16_speedup_vs_fp32"] = round(ratio, 3)
    line["torch_threads"] = torch.get_num_threads()
    line["cpu"] = cpu()
    line["gpu"] = gpu()
    print(json.dumps(line))
    from megatron_rlhf.parallel import init

    init.destroy()  # NCCL warns of a process group left to the interpreter's exit


if __name__ == "__main__":
    main()
