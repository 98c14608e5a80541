"""A process that used the parallel layer ends clean: nothing of it is running when the interpreter shuts down.

A daemon thread inside a pybind11 call, or a live gloo group, while Python finalises can end the process in
std::terminate ("terminate called without an active exception", exit 134) after its work is done. Each check
runs in a fresh interpreter, a world of one.
"""

import ast
import subprocess
import sys

from tests.distributed.launch import ROOT, child_env, free_port

_NATIVE_THREADS = """
import gc, time
import torch
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from tests.conftest import native_thread_names

native = lambda: sorted(native_thread_names().values())

init.initialize(ParallelConfig(), seed=1)
cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=67, max_position_embeddings=16)
(model,) = build_model(cfg, ParallelConfig())
ids = torch.randint(0, 67, (2, 8))
model(ids, torch.arange(8).expand(2, 8), None)  # fills Megatron's cache of rotary tables, keyed by the module
print("during", native())
del model
init.destroy()
gc.collect()  # a model's hooks hold it in reference cycles
deadline = time.monotonic() + 5
while any(n.startswith(("pt_gloo", "gloo", "pt_tcpstore")) for n in native()) and time.monotonic() < deadline:
    time.sleep(0.1)
print("after", native())
"""

_EXIT_WITHOUT_DESTROY = """
import atexit, sys, threading

# Registered before the package is imported, so it runs last (atexit is LIFO), after whatever the package registered.
atexit.register(lambda: print("watchdog alive at exit:", sys.modules["megatron_rlhf.parallel.watchdog"]._current
                              is not None or any(t.name == "megatron-rlhf-watchdog" for t in threading.enumerate()),
                              flush=True))
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig

init.initialize(ParallelConfig(), seed=1)
assert any(t.name == "megatron-rlhf-watchdog" for t in threading.enumerate())
"""


def _run(code: str) -> str:
    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0"})
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_destroy_ends_every_gloo_and_store_thread():
    """After megatron-core 0.16.1's destroy_model_parallel, two of its globals and the rotary embeddings' forward
    cache still reference groups, which keep their gloo threads and the TCP store's server thread running:
    `init.destroy` clears them too."""
    lines = dict(line.split(" ", 1) for line in _run(_NATIVE_THREADS).splitlines())
    during, after = ast.literal_eval(lines["during"]), ast.literal_eval(lines["after"])
    assert "pt_gloo_runloop" in during and "pt_tcpstore_uv" in during, during
    assert not [n for n in after if n.startswith(("pt_gloo", "gloo", "pt_tcpstore"))], after


def test_the_watchdog_thread_is_joined_before_the_interpreter_finalises():
    """A caller of `parallel.init.initialize` that never calls `destroy()`: the watchdog's daemon thread, which
    calls into the TCP store every second, is stopped by atexit, before finalisation."""
    out = _run(_EXIT_WITHOUT_DESTROY)
    assert "watchdog alive at exit: False" in out, out
