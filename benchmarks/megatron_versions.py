"""The PPO iteration on several megatron-core / Python installs side by side: `ppo_iteration.py` run by each
interpreter in turn, `--rounds` times, one JSON line with every leg's seconds per iteration and the ratios to the
first leg.

    python benchmarks/megatron_versions.py \\
        a=python b=/tmp/v312/bin/python:/tmp/mc016 c=/tmp/v312/bin/python [--shape smollm2-135m] [--rounds 2]

A leg is NAME=INTERPRETER[:DIR]: DIR goes first on PYTHONPATH, e.g. megatron-core 0.16.1 installed beside a
Python 3.12 venv with `pip install --no-deps --target DIR megatron-core==0.16.1`, so two legs differ in
megatron-core alone (docs/performance.md, "megatron-core 0.16.1 against 0.19.2"). Extra arguments after `--` go
to ppo_iteration.py (default `--no-trl`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_leg(interpreter: str, path: str, args: list) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, str(HERE.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([interpreter, str(HERE / "ppo_iteration.py"), *args], env=env, check=True,
                         capture_output=True, text=True, cwd=str(HERE.parent)).stdout
    record = json.loads(out.strip().splitlines()[-1])
    version = subprocess.run([interpreter, "-c", "import importlib.metadata as m, sys, torch; print(m.version("
                              "'megatron-core'), sys.version.split()[0], torch.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
    return {"s_per_iter": record["s_per_iter"], "phase_seconds": record["phase_seconds"],
            "megatron_core": version[0], "python": version[1], "torch": version[2]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("legs", nargs="+", help="NAME=INTERPRETER[:PYTHONPATH_DIR]")
    parser.add_argument("--shape", default="reference")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"] or ["--no-trl"]
    bench = [*extra, "--shape", args.shape] + (["--repeats", str(args.repeats)] if args.repeats else [])
    legs = [(name, *(spec.split(":", 1) + [""])[:2]) for name, spec in (leg.split("=", 1) for leg in args.legs)]
    rounds = []
    for _ in range(args.rounds):
        rounds.append({name: run_leg(python, path, bench) for name, python, path in legs})
    first = legs[0][0]
    ratios = [{name: r[name]["s_per_iter"] / r[first]["s_per_iter"] for name, _, _ in legs} for r in rounds]
    print(json.dumps({"shape": args.shape, "rounds": rounds, f"ratio_to_{first}": ratios}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
