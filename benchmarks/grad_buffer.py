"""bf16 PPO iterations with DDP's gradient buffers zeroed by their first write against zeroed ones, side by side.

    python benchmarks/grad_buffer.py [--repeats 3]

bf16 only: buffers of fp32 weights are zeroed either way (parallel/grad_buffer.py). One process, one rank,
2 threads, the SmolLM2-135M shape of benchmarks/ppo_iteration.py (random weights, 16
prompts, 64 new tokens, 2 minibatches x 4 epochs). The same run alternates the two ways of starting each
training step's gradients (`parallel/grad_buffer.py` against Megatron's `zero_grad_buffer`), in the order
AB, BA, AB, ..., so the VM's drift slows both alike. Ends with one JSON line: the median seconds per
iteration each way and `speedup` = zeroed / first-write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import machine  # noqa: E402
from benchmarks.ppo_iteration import prepare, setup, timed_iteration  # noqa: E402
from benchmarks.shapes import SMOLLM2_135M  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.dtype = "bfloat16"
    machine.refuse_emulated_dtypes(parser, [args.dtype])
    from megatron_rlhf.parallel import grad_buffer

    model_cfg, parallel = setup(SMOLLM2_135M, args.dtype)
    ours = prepare(model_cfg, parallel, 64)  # includes a warm-up iteration
    seconds = {"first_write": [], "zeroed": []}
    for i in range(args.repeats):
        for side in ("first_write", "zeroed") if i % 2 == 0 else ("zeroed", "first_write"):
            zeroed = mock.patch.object(grad_buffer, "_lazy", return_value=False)  # Megatron's zero_grad_buffer
            with zeroed if side == "zeroed" else contextlib.nullcontext():
                seconds[side].append(timed_iteration(ours, {}))
            print(f"  {side}, iteration {len(seconds[side])}: {seconds[side][-1]:.3f} s", flush=True)
    median = {side: statistics.median(s) for side, s in seconds.items()}
    print(f"SmolLM2-135M PPO iteration, {args.dtype}: first-write buffers {median['first_write']:.3f} s, "
          f"zeroed buffers {median['zeroed']:.3f} s")
    print(json.dumps({"dtype": args.dtype, "s_first_write": round(median["first_write"], 4),
                      "s_zeroed": round(median["zeroed"], 4),
                      **{f"s_{side}_each": [round(s, 4) for s in each] for side, each in seconds.items()},
                      "speedup": round(median["zeroed"] / median["first_write"], 4),
                      "torch_threads": torch.get_num_threads(), "cpu": machine.cpu()}))


if __name__ == "__main__":
    main()
