"""algo/ is pure math: importing it must not pull in megatron, vllm, transformers or omegaconf."""

import ast
import json
import os
import subprocess
import sys

FORBIDDEN = ["megatron.core", "megatron", "vllm", "transformers", "omegaconf"]


def test_importing_algo_imports_no_framework():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import sys, json\n"
        "import megatron_rlhf.algo\n"
        "from megatron_rlhf.algo import advantages, kl, losses, masked, rewards\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    leaked = json.loads(out.stdout.strip().splitlines()[-1])
    assert leaked == [], f"megatron_rlhf.algo imported {leaked}"


def test_algo_sources_never_call_item():
    algo = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_rlhf", "algo")
    for name in os.listdir(algo):
        if name.endswith(".py"):
            with open(os.path.join(algo, name)) as f:
                tree = ast.parse(f.read())
            calls = [
                n.lineno
                for n in ast.walk(tree)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("item", "tolist")
            ]
            assert not calls, f"algo/{name} line(s) {calls} call .item()/.tolist() (a host-device sync)"
