"""Every ```python block of README.md and docs/*.md runs as written (blocks that need a server or a
GPU are fenced as console or bash sessions instead), and the README's blocks use the public API
alone: the package root and ``kvcanary.ops``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, code) for page in PAGES
          for code in re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.M | re.S)]
NEEDS = {"transformers": "transformers", "openai": "openai", "fastapi": "fastapi", "vllm": "vllm"}


def _ids() -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for page, _ in BLOCKS:
        seen[page.name] = seen.get(page.name, -1) + 1
        out.append(f"{page.name}-block{seen[page.name]}")
    return out


def test_the_pages_have_runnable_python_blocks_and_no_other_python_fence():
    assert sum(page.name == "README.md" for page, _ in BLOCKS) >= 1
    assert len(BLOCKS) >= 3  # the README's quick start, the admin routes, transformers
    for page in PAGES:
        fences = re.findall(r"^```(\w*)$", page.read_text(), flags=re.M)
        assert all(f in ("", "python", "bash", "console", "json") for f in fences), (page.name, fences)


def test_the_readme_blocks_import_the_public_api_only():
    for page, code in BLOCKS:
        if page.name != "README.md":
            continue
        modules = re.findall(r"^(?:from|import) (kvcanary[\w.]*)", code, flags=re.M)
        assert modules and set(modules) <= {"kvcanary", "kvcanary.ops"}, modules


@pytest.mark.parametrize("page, code", BLOCKS, ids=_ids())
def test_python_block_runs_as_written(page, code, tmp_path):
    for word, module in NEEDS.items():
        if re.search(rf"^(from|import) {word}\b", code, flags=re.M):
            pytest.importorskip(module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{page.name} block failed:\n{code}\n--- stderr ---\n{out.stderr[-3000:]}"
