"""Peak memory of HF <-> Megatron conversion on a generated multi-shard model.

    python benchmarks/convert_memory.py [--layers 24 --hidden 2048 --ffn 5632 --vocab 32000] [--workdir DIR]

Generates a random Llama-style bf16 checkpoint as sharded safetensors (in a separate process, so
generation does not count), then runs each conversion in a fresh process and reads its peak RSS
(`ru_maxrss`), after first reading it once the converter's imports are done: that baseline
(Python + torch + megatron-core) is paid by any conversion, whatever the model size.

Prints one JSON line: peak_rss_bytes (HF -> Megatron), export_peak_rss_bytes (Megatron -> HF),
baseline_rss_bytes / export_baseline_rss_bytes, model_bytes, largest_layer_bytes (largest decoder layer, all its tensors),
largest_tensor_bytes, and the ratios of (peak - baseline) to the layer and model sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Everything the converter imports is imported first, so BASE is the interpreter + libraries and
# PEAK - BASE is what converting costs.
_WRAP = r"""
import resource, sys, json
import torch, safetensors, tqdm
import torch.distributed.checkpoint
import megatron.core.dist_checkpointing.core
import megatron_rlhf.checkpoint.hf
print("BASE=" + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
{body}
print("PEAK=" + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
"""


def run_measured(body: str, *args: str) -> tuple:
    """(baseline, peak) RSS in bytes of a fresh interpreter running `body` (Linux ru_maxrss is KiB)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _WRAP.format(body=body), *args],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line[:5] in ("BASE=", "PEAK="))
    if len(found) != 2:
        raise RuntimeError(f"no memory figures reported:\n{proc.stdout}\n{proc.stderr}")
    return int(found["BASE"]), int(found["PEAK"])


GENERATE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
out, L, H, F, V, heads, groups = Path(sys.argv[1]), *map(int, sys.argv[2:8])
hd = H // heads
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": F,
       "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": groups, "vocab_size": V,
       "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
       "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16"}
out.mkdir(parents=True)
(out / "config.json").write_text(json.dumps(cfg))
def layer(i):
    p = f"model.layers.{i}."
    shapes = {p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (groups * hd, H),
              p + "self_attn.v_proj.weight": (groups * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
              p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F),
              p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    return {k: (torch.randn(s) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
shards = [{"model.embed_tokens.weight": (torch.randn(V, H) * 0.02).to(torch.bfloat16)}]
shards += [layer(i) for i in range(L)]
shards += [{"model.norm.weight": torch.ones(H, dtype=torch.bfloat16), "lm_head.weight": (torch.randn(V, H) * 0.02).to(torch.bfloat16)}]
n = len(shards); weight_map = {}; total = 0; layer_bytes = []; largest_tensor = 0
for i, sd in enumerate(shards):
    name = f"model-{i+1:05d}-of-{n:05d}.safetensors"
    save_file(sd, str(out / name), metadata={"format": "pt"})
    nb = sum(t.numel() * t.element_size() for t in sd.values())
    total += nb
    largest_tensor = max([largest_tensor] + [t.numel() * t.element_size() for t in sd.values()])
    if 0 < i < n - 1:
        layer_bytes.append(nb)
    weight_map.update({k: name for k in sd})
    del sd
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
(out / "sizes.json").write_text(json.dumps({"model_bytes": total, "largest_layer_bytes": max(layer_bytes), "largest_tensor_bytes": largest_tensor}))
"""

TO_MEGATRON = r"""
from megatron_rlhf.checkpoint.hf import hf_to_megatron
hf_to_megatron(sys.argv[1], sys.argv[2])
"""

TO_HF = r"""
from megatron_rlhf.checkpoint.hf import megatron_to_hf
megatron_to_hf(sys.argv[1], sys.argv[2])
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--workdir", default=None, help="where the generated model and outputs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    a = p.parse_args(argv)

    work = Path(a.workdir or tempfile.mkdtemp(prefix="convert_memory_"))
    hf, mg, back = work / "hf", work / "megatron", work / "hf_back"
    try:
        run_measured(GENERATE, str(hf), *map(str, (a.layers, a.hidden, a.ffn, a.vocab, a.heads, a.groups)))
        sizes = json.loads((hf / "sizes.json").read_text())
        (hf / "sizes.json").unlink()
        baseline, peak = run_measured(TO_MEGATRON, str(hf), str(mg))
        export_baseline, export_peak = run_measured(TO_HF, str(mg), str(back))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "peak_rss_bytes": peak,
        "export_peak_rss_bytes": export_peak,
        "baseline_rss_bytes": baseline,
        "export_baseline_rss_bytes": export_baseline,
        **sizes,
        "num_shards": a.layers + 2,
        "peak_minus_baseline_over_largest_layer": round((peak - baseline) / sizes["largest_layer_bytes"], 2),
        "peak_minus_baseline_over_model": round((peak - baseline) / sizes["model_bytes"], 3),
        "export_peak_minus_baseline_over_largest_layer": round(
            (export_peak - export_baseline) / sizes["largest_layer_bytes"], 2
        ),
        "export_peak_minus_baseline_over_model": round((export_peak - export_baseline) / sizes["model_bytes"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
