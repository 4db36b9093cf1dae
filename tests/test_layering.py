"""The layering of DESIGN.md §5 holds for every module of the package: imports point down only,
no import cycle (late imports included; a type-only import under ``TYPE_CHECKING`` never
runs), no private module imported from another package.

    cli / server > runs > faults > engine / adapters > distributed > runtime > ops > core

``config`` and ``errors`` sit beside ``core``/``ops``; ``bench`` measures ``ops`` and ``runtime``;
``incident`` renders a run's JSON report for the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcanary"
BASE = {"core", "errors"}
# layer -> the kvcanary layers it may import (itself included)
ALLOWED = {
    "errors": {"errors"},
    "core": BASE,
    "ops": BASE | {"ops"},
    "config": BASE | {"config"},
    "runtime": BASE | {"ops", "config", "runtime"},
    "distributed": BASE | {"ops", "config", "runtime", "distributed"},
    "engine": BASE | {"ops", "config", "runtime", "distributed", "engine"},
    "adapters": BASE | {"ops", "config", "runtime", "adapters", "__init__"},  # __init__: the public API
    "faults": BASE | {"ops", "config", "runtime", "engine", "faults"},
    "runs": BASE | {"ops", "config", "runtime", "distributed", "engine", "adapters", "faults", "runs"},
    "bench": BASE | {"ops", "config", "runtime", "bench"},
    "incident": BASE | {"incident"},
    "server": BASE | {"ops", "config", "runtime", "distributed", "engine", "adapters", "faults", "runs", "server"},
    "cli": BASE | {"ops", "config", "runtime", "distributed", "engine", "adapters", "faults", "runs", "bench",
                   "incident", "server", "cli", "__init__"},
    "__init__": BASE | {"ops", "config", "runtime", "__init__"},  # the public API re-exports these
    "__main__": {"cli", "__main__"},
}
MODULES = sorted(SRC.rglob("*.py"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


NAMES = {_module(p) for p in MODULES}


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING" for stmt in node.body for n in ast.walk(stmt)}


def _imports(path: Path, type_only: bool = True) -> set[str]:
    """Every kvcanary module ``path`` imports, anywhere in the file (late imports included, and
    type-only ones unless ``type_only=False``); ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module."""
    out = set()
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvcanary")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvcanary"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & NAMES
            out |= subs or {node.module}
    return out


GRAPH = {_module(p): _imports(p) for p in MODULES}
RUNTIME_GRAPH = {_module(p): _imports(p, type_only=False) for p in MODULES}  # what executes: for cycles


def test_every_module_has_a_layer():
    unknown = sorted({_layer(m) for m in GRAPH} - set(ALLOWED))
    assert not unknown, f"modules of {unknown} have no layer; add them to ALLOWED (DESIGN.md §5)"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    module = _module(path)
    layer = _layer(module)
    bad = sorted({_layer(m) for m in GRAPH[module]} - ALLOWED.get(layer, set()))
    assert not bad, f"{module} ({layer}) imports {bad}; allowed: {sorted(ALLOWED.get(layer, ()))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_module_of_another_package(path):
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bad = sorted(m for m in GRAPH[module] if any(p.startswith("_") for p in m.split(".")[1:])
                 and m.rpartition(".")[0] != package)
    assert not bad, f"{module} imports private {bad} of another package; import a public module instead"


def _cycle() -> list[str] | None:
    """One import cycle among the modules, or None (depth-first search, edges to modules only)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(RUNTIME_GRAPH.get(m, ())):
            if n not in RUNTIME_GRAPH:
                continue
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(RUNTIME_GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_checks_can_fail(tmp_path):
    """The cycle search and the private-module rule catch what they are for."""
    global RUNTIME_GRAPH
    saved = RUNTIME_GRAPH
    try:
        RUNTIME_GRAPH = {"kvcanary.a.x": {"kvcanary.a.y"}, "kvcanary.a.y": {"kvcanary.a.x"}}
        assert _cycle() == ["kvcanary.a.x", "kvcanary.a.y", "kvcanary.a.x"]
    finally:
        RUNTIME_GRAPH = saved
    f = tmp_path / "m.py"
    f.write_text("from kvcanary.ops._common import HAS_TRITON\nimport kvcanary.engine.pool\n"
                 "if TYPE_CHECKING:\n    from kvcanary.runs.setup import RunSetup\n")
    assert _imports(f) == {"kvcanary.ops._common", "kvcanary.engine.pool", "kvcanary.runs.setup"}
    assert _imports(f, type_only=False) == {"kvcanary.ops._common", "kvcanary.engine.pool"}


@pytest.mark.parametrize("path", sorted((SRC.parents[1] / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_import_public_modules_only(path):
    bad = sorted(m for m in _imports(path) if any(p.startswith("_") for p in m.split(".")[1:]))
    assert not bad, f"{path.name} imports private {bad}; import a public module instead"
