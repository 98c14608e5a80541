#!/usr/bin/env python
"""Megatron distributed checkpoint -> HF directory (sharded safetensors, config.json, tokenizer files).

    python tools/convert_megatron_to_hf.py --megatron-dir IN --out OUT [--overwrite]

Same as `megatron-rlhf convert megatron-to-hf ...`; see megatron_rlhf/checkpoint/hf.py and docs/convert.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlhf.checkpoint.convert_cli import megatron_to_hf_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(megatron_to_hf_main(sys.argv[1:]))
