"""models/norm_glu.py's RMSNorm and SwiGLU against torch's RMSNorm and Megatron's `glu`, side by side.

    python benchmarks/norm_glu.py [--dtype bfloat16|float32] [--repeats 12]

One forward+backward of the SmolLM2-135M decoder (benchmarks/shapes.py, random weights) on 8 rows x 80 tokens,
the shape of a PPO training micro-batch at the realistic shape, one rank, 2 threads. The same model alternates
between the two kinds of layers (same weights, switched in place) every repetition, so the VM's drift slows
both alike. Ends with one JSON line: the median seconds each way and `speedup` = torch's / ours.
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
import torch.nn.functional as F  # noqa: E402

from benchmarks import machine  # noqa: E402
from benchmarks.ppo_iteration import setup  # noqa: E402
from benchmarks.shapes import SMOLLM2_135M  # noqa: E402


class MegatronGLU(torch.nn.Module):
    """Megatron's `glu` (mlp.py) on fc1's whole output, as a module the MLP can call."""

    def forward(self, x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up


def switch(model, ours: bool) -> None:
    from megatron_rlhf.models.norm_glu import RMSNorm, SwiGLU

    for layer in model.decoder.layers:
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            norm.__class__ = RMSNorm if ours else torch.nn.RMSNorm
        layer.mlp.activation_func = SwiGLU() if ours else MegatronGLU()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    machine.refuse_emulated_dtypes(parser, [args.dtype])
    from megatron_rlhf.models.build import build_model_chunk

    model_cfg, parallel = setup(SMOLLM2_135M, args.dtype)
    model = build_model_chunk(model_cfg, parallel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (8, 80), generator=g)
    position_ids = torch.arange(80).expand(8, -1)
    seconds = {"ours": [], "torch": []}
    for i in range(args.repeats + 1):  # the first round warms up
        for side in ("ours", "torch") if i % 2 else ("torch", "ours"):
            switch(model, side == "ours")
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            logits = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
            logits[:, -64:].float().logsumexp(-1).mean().backward()
            if i:
                seconds[side].append(time.perf_counter() - start)
    median = {side: statistics.median(s) for side, s in seconds.items()}
    print(f"SmolLM2-135M forward+backward, {args.dtype}, 8 x 80 tokens: ours {median['ours']:.3f} s, "
          f"torch RMSNorm + Megatron glu {median['torch']:.3f} s")
    print(json.dumps({"dtype": args.dtype, "s_ours": round(median["ours"], 4), "s_torch": round(median["torch"], 4),
                      "s_ours_each": [round(s, 4) for s in seconds["ours"]],
                      "s_torch_each": [round(s, 4) for s in seconds["torch"]],
                      "speedup": round(median["torch"] / median["ours"], 4), "torch_threads": torch.get_num_threads(),
                      "cpu": machine.cpu()}))


if __name__ == "__main__":
    main()
