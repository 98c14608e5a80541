#!/usr/bin/env python
"""Submit (or with --dryrun, write) the Slurm job of a stage: see megatron_rlhf/slurm/submit.py.

    python slurm/launch.py ppo examples/llama3_70b_ppo.yaml --cluster examples/llama3_70b_slurm.yaml --dryrun
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlhf import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main(["submit", *sys.argv[1:]]))
