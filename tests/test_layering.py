"""The layering of DESIGN.md §5 holds: imports point down only, and the runtime never imports the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcanary"
# layer -> the kvcanary layers it may import (itself included)
ALLOWED = {
    "core": {"core", "errors"},
    "ops": {"core", "ops", "errors"},
    "config": {"core", "ops", "errors"},
    "runtime": {"core", "ops", "runtime", "config", "errors"},
    "engine": {"core", "ops", "runtime", "distributed", "engine", "config", "errors"},
    "adapters": {"core", "ops", "runtime", "adapters", "config", "errors"},
    "distributed": {"core", "ops", "runtime", "distributed", "config", "errors"},
    "faults": {"core", "ops", "runtime", "engine", "faults", "config", "errors"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0].removesuffix(".py")


def _kvcanary_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvcanary" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    layer = _layer(path)
    if layer not in ALLOWED:
        return  # cli, server, __main__, workload: the top may import anything
    bad = _kvcanary_imports(path) - ALLOWED[layer]
    assert not bad, f"{path.relative_to(SRC)} ({layer}) imports {sorted(bad)}; allowed: {sorted(ALLOWED[layer])}"
