"""Where numba is missing or does not import, the compiled CPU kernels step aside: the ops and
the runtime run the torch paths (same results), and asking for ``Backend.NUMBA`` is a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvcanary.errors import InputError
from kvcanary.ops import _cpu
from kvcanary.ops._common import Backend
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceState
from kvcanary.ops.verify import verify


def _verify_once(backend: Backend) -> list[int]:
    state = DeviceState.allocate(8)
    plan = Plan.allocate(4, 1)
    plan.slot[:2] = torch.tensor([3, 5], dtype=torch.int32)
    plan.position[:2] = torch.tensor([0, 1], dtype=torch.int32)
    plan.count.fill_(2)
    plan.enable.fill_(1)
    verify(state=state, plan=plan, tag=0, backend=backend)
    return state.ring[: int(state.ring_counter[0])].flatten().tolist()


def test_without_numba_the_torch_path_serves(monkeypatch):
    want = _verify_once(Backend.TORCH)
    assert want  # the zeroed records break the chain of position 0: rows to compare
    monkeypatch.setattr(_cpu, "HAS_NUMBA", False)
    monkeypatch.setattr(_cpu, "_usable", None)
    assert not _cpu.usable()
    assert _verify_once(Backend.AUTO) == want
    with pytest.raises(InputError, match="numba backend was requested but numba is not installed"):
        _verify_once(Backend.NUMBA)


def test_a_numba_that_fails_to_import_falls_back_with_one_warning(tmp_path):
    broken = tmp_path / "numba"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('numba built against another numpy')\n")
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from kvcanary import Canary, CanaryConfig
        from kvcanary.runtime.canary import PoolGeometry
        canary = Canary(CanaryConfig(), PoolGeometry(16, 4, 8))
        print("backend", canary.backend, "fused", canary.fused)
    """)
    env_path = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "backend None fused False" in out.stdout
    assert out.stdout.count("the compiled CPU kernels are unavailable (ImportError: numba built against") == 1
