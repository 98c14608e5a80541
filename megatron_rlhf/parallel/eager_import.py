"""On a machine without CUDA, import megatron-core without compiling its fusion helpers.

megatron-core 0.16.1 wraps its fusion helpers (bias-GeLU/SwiGLU, squared ReLU, L2 norm, ...) in
`torch.compile` when they are defined (`megatron/core/jit.py`: `jit_fuser = torch.compile`). The wrapping
alone imports torch's compiler stack (dynamo and inductor): measured on the 2-core machine, about 2.8 s of
a 5.3 s megatron-core import, paid by every rank of every run and test. None of those helpers runs here on
CPU (`parallel/cpu.py` switches the fused paths off). So without CUDA the first `import megatron.core` runs
with `torch.compile` as the identity, and `megatron.core.jit.jit_fuser` stays the identity for the modules
imported later; with CUDA nothing changes. `torch.compile` itself is put back right after.

`install()` (called by `megatron_rlhf/__init__.py`) adds a one-shot import hook; it imports nothing, so
`import megatron_rlhf` stays light. If megatron-core is already imported, the hook never fires.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "megatron.core"


def _identity_compile(model=None, **_kwargs):
    """`torch.compile` as the identity: `torch.compile(f)` and `@torch.compile(...)` return f."""
    return model if model is not None else (lambda fn: fn)


class _EagerLoader(importlib.abc.Loader):
    """megatron.core's own loader, executing the package with torch.compile as the identity (no CUDA)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # resource readers etc.: the real loader's
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        import torch

        if torch.cuda.is_available():
            return self.inner.exec_module(module)
        compile_ = torch.compile
        torch.compile = _identity_compile
        try:
            self.inner.exec_module(module)
            from megatron.core import jit

            jit.disable_jit_fuser()  # helpers defined by modules imported later stay plain functions too
        finally:
            torch.compile = compile_


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        uninstall()  # one shot; and the lookup below must not find this hook again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _EagerLoader(spec.loader)
        return spec


def install() -> None:
    if TARGET not in sys.modules and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]
