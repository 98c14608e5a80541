"""Command lines of HF <-> Megatron conversion (`megatron-rlhf convert ...`, tools/convert_*.py).

Each `*_main(argv, prog)` parses its arguments, runs the conversion in checkpoint/hf.py and turns a
`ConversionError` into one `error:` line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_rlhf.checkpoint.gguf import gguf_as_hf_dir
from megatron_rlhf.checkpoint.hf import DTYPES, hf_to_megatron, megatron_to_hf
from megatron_rlhf.checkpoint.out_dir import check_output_dir
from megatron_rlhf.models.hf_mapping import ConversionError



def _run(fn, argv) -> int:
    try:
        fn(argv)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def hf_to_megatron_main(argv: Optional[Sequence[str]] = None, prog: str = "convert_hf_to_megatron.py") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="HF directory (Llama/Mistral/Qwen2, causal LM or sequence classifier) -> Megatron torch_dist "
        "checkpoint that loads at any TP/PP.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="HF model directory (config.json + safetensors or .bin)")
    src.add_argument("--gguf", help="a GGUF file (llama.cpp): dequantised to --dtype (default float32) through "
                     "transformers, its tokenizer and chat template carried along (checkpoint/gguf.py)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--head",
        choices=["lm", "scalar"],
        default=None,
        help="lm: causal LM; scalar: reward/value model (a causal LM gets a fresh zero head). Default: the source's",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="stored dtype (default: config's)")
    p.add_argument("--target-tp", type=int, default=None, help="also check this tensor-parallel size splits the weights")
    p.add_argument("--key-prefix", default="", help='prefix for every checkpoint key, e.g. "policy."')
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def convert(hf_dir, source=None):
        hf_to_megatron(
            hf_dir,
            args.out,
            head=args.head,
            dtype=args.dtype,
            overwrite=args.overwrite,
            target_tp=args.target_tp,
            key_prefix=args.key_prefix,
            progress=not args.quiet,
            source=source,
        )

    def go(_):
        if args.gguf is None:
            convert(args.hf_dir)
        else:
            check_output_dir(Path(args.out), args.overwrite, "megatron")  # before the minutes of loading
            scratch = Path(args.out).absolute().parent
            scratch.mkdir(parents=True, exist_ok=True)
            with gguf_as_hf_dir(args.gguf, args.dtype, scratch, progress=not args.quiet) as hf_dir:
                convert(hf_dir, source=str(Path(args.gguf).absolute()))
        print(f"wrote {args.out}")

    return _run(go, argv)


def megatron_to_hf_main(argv: Optional[Sequence[str]] = None, prog: str = "convert_megatron_to_hf.py") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Megatron torch_dist checkpoint (with megatron_rlhf_meta.json) -> HF directory with sharded "
        "safetensors, config.json and tokenizer files.",
    )
    p.add_argument("--megatron-dir", required=True, help="checkpoint directory written by convert_hf_to_megatron or training")
    p.add_argument("--out", required=True, help="output HF directory (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="output dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    p.add_argument(
        "--hf-config",
        default=None,
        help="for a checkpoint without megatron_rlhf_meta.json (e.g. from training): the HF directory "
        "(or config.json) the model came from",
    )
    p.add_argument("--head", choices=["lm", "scalar"], default=None, help="with --hf-config: the model's head")
    p.add_argument("--key-prefix", default=None, help='with --hf-config: key prefix in the checkpoint, e.g. "policy."')
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def go(_):
        megatron_to_hf(
            args.megatron_dir,
            args.out,
            overwrite=args.overwrite,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
            hf_config_dir=args.hf_config,
            head=args.head,
            key_prefix=args.key_prefix,
            progress=not args.quiet,
        )
        print(f"wrote {args.out}")

    return _run(go, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`convert hf-to-megatron ...` / `convert megatron-to-hf ...` (for the `megatron-rlhf` CLI)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"hf-to-megatron": hf_to_megatron_main, "megatron-to-hf": megatron_to_hf_main}
    if not argv or argv[0] not in commands:
        print(f"usage: megatron-rlhf convert {{{'|'.join(commands)}}} ... (--help after one shows its arguments)",
              file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return commands[argv[0]](argv[1:], prog=f"megatron-rlhf convert {argv[0]}")

