"""Every ```python block of README.md runs as written (blocks that need a server or a GPU are
fenced as console or bash sessions instead)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, flags=re.M | re.S)
NEEDS = {"transformers": "transformers", "openai": "openai", "fastapi": "fastapi"}


def test_the_readme_has_runnable_python_blocks_and_no_other_python_fence():
    assert len(BLOCKS) >= 2
    fences = re.findall(r"^```(\w*)$", README, flags=re.M)
    assert all(f in ("", "python", "bash", "console") for f in fences), fences


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_python_block_runs_as_written(code, tmp_path):
    for word, module in NEEDS.items():
        if re.search(rf"^(from|import) {word}\b", code, flags=re.M):
            pytest.importorskip(module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{out.stderr[-3000:]}"
