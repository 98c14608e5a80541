"""The house as drawn in docs/architecture.md: which package may import which, and no import circles.

Reads every import statement with `ast` (function-level imports included), so an arrow against the
rule or a circle fails here before it can grow.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "megatron_rlhf"

# What each part of megatron_rlhf may import of the others (a name is a package, or one module of it).
# Everything else is an arrow against the rule. Keep docs/architecture.md in step with this table.
ALLOWED: Dict[str, Set[str]] = {
    "algo": set(),
    "parallel": set(),
    "tasks": set(),
    "models": {"algo", "parallel"},
    "config": {"parallel", "models.spec"},  # a model's description, never what builds one
    "data": {"config"},
    "checkpoint": {"models", "parallel"},
    "rollout": {"algo", "config", "data", "models", "parallel"},
    "trainer": {"algo", "checkpoint", "config", "data", "models", "parallel", "rollout", "tasks"},
    "plan": {"config", "models", "parallel"},
    "slurm": {"config", "plan"},
    "report": {"checkpoint.record", "trainer.metrics", "trainer.ppo.doctor"},  # reads run directories, builds nothing
    "launch": {"parallel"},
    "cli": {"config", "parallel"},  # the stages themselves are named by string and imported on demand
    "": {"parallel.eager_import"},  # megatron_rlhf/__init__.py
}
# Inside trainer/: the machinery every stage shares sees no stage; DPO builds on PPO's models and eval.
TRAINER_STAGES = {"ppo": {"ppo"}, "dpo": {"dpo", "ppo"}}


def _modules(folder: pathlib.Path, prefix: str) -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([prefix, *parts]) if prefix else ".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, known: Dict[str, pathlib.Path]) -> List[Tuple[str, int]]:
    """(imported module, line) for every import in the file that names one of `known`."""
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno))
    return found


def _graph(modules: Dict[str, pathlib.Path]) -> Dict[str, List[Tuple[str, int]]]:
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: Dict[str, List[Tuple[str, int]]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each one import circle."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _part(module: str) -> str:
    """megatron_rlhf.trainer.ppo.fit -> 'trainer'; megatron_rlhf -> ''."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    return rest.split(".")[0]


def _allowed(src: str, dst: str) -> bool:
    a, b = _part(src), _part(dst)
    if a == b:
        return a != "trainer" or _trainer_allowed(src, dst)
    rel = dst[len(PACKAGE) + 1:]
    return any(rel == name or rel.startswith(name + ".") for name in ALLOWED.get(a, set()))


def _trainer_allowed(src: str, dst: str) -> bool:
    def stage(m):
        parts = m.split(".")
        return parts[2] if len(parts) > 3 and parts[2] in TRAINER_STAGES else None

    s, d = stage(src), stage(dst)
    return d is None or (s is not None and d in TRAINER_STAGES[s])


PACKAGE_MODULES = _modules(ROOT / PACKAGE, PACKAGE)


def test_every_part_of_the_package_is_in_the_table():
    parts = {_part(m) for m in PACKAGE_MODULES}
    assert parts == set(ALLOWED), f"add to ALLOWED (and docs/architecture.md): {sorted(parts ^ set(ALLOWED))}"


def test_no_arrow_against_the_import_rule():
    bad = [f"{PACKAGE_MODULES[src].relative_to(ROOT)}:{line} imports {dst}"
           for src, edges in _graph(PACKAGE_MODULES).items() for dst, line in edges if not _allowed(src, dst)]
    assert bad == [], "arrows against the rule in docs/architecture.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder,prefix", [(PACKAGE, PACKAGE), ("benchmarks", ""), ("tests", "tests")])
def test_no_import_circle(folder, prefix):
    modules = _modules(ROOT / folder, prefix)
    if folder != PACKAGE:
        modules.update(PACKAGE_MODULES)  # a circle through the package counts too
    assert _cycles(_graph(modules)) == []


def test_nothing_imports_cli():
    everything = {**PACKAGE_MODULES, **_modules(ROOT / "benchmarks", ""), **_modules(ROOT / "tools", "tools")}
    users = [m for m, edges in _graph(everything).items() if any(d == f"{PACKAGE}.cli" for d, _ in edges)]
    assert users == []


def test_the_checker_sees_a_circle_and_a_bad_arrow(tmp_path):
    """The checks above can fail: a made-up package with a circle and a models -> trainer arrow."""
    pkg = tmp_path / PACKAGE
    (pkg / "models").mkdir(parents=True)
    (pkg / "trainer").mkdir()
    for f in ("__init__.py", "models/__init__.py", "trainer/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from megatron_rlhf.trainer import b\n")
    (pkg / "trainer" / "b.py").write_text("from megatron_rlhf.models.a import f\n")
    modules = _modules(pkg, PACKAGE)
    graph = _graph(modules)
    assert _cycles(graph) == [[f"{PACKAGE}.models.a", f"{PACKAGE}.trainer.b"]]
    assert not _allowed(f"{PACKAGE}.models.a", f"{PACKAGE}.trainer.b")
    assert _allowed(f"{PACKAGE}.trainer.b", f"{PACKAGE}.models.a")
    assert not _allowed(f"{PACKAGE}.trainer.run", f"{PACKAGE}.trainer.ppo.fit")
    assert _allowed(f"{PACKAGE}.trainer.dpo.fit", f"{PACKAGE}.trainer.ppo.models")
