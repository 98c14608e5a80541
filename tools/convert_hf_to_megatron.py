#!/usr/bin/env python
"""HF directory -> Megatron distributed checkpoint (torch_dist) that loads at any TP/PP.

    python tools/convert_hf_to_megatron.py --hf-dir IN --out OUT [--overwrite] [--head lm|scalar]

Same as `megatron-rlhf convert hf-to-megatron ...`; see megatron_rlhf/checkpoint/hf.py and docs/convert.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlhf.checkpoint.convert_cli import hf_to_megatron_main  # noqa: E402

if __name__ == "__main__":  # dist_checkpointing may start a spawn manager: keep the entry point import-safe
    sys.exit(hf_to_megatron_main(sys.argv[1:]))
