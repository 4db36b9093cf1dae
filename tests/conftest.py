"""Test-wide setup: run Triton kernels under the interpreter when there is no GPU, and the
hypothesis profiles (``--hypothesis-profile thorough`` for a longer local run)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # The interpreter switch must be set before triton is imported; torch itself does not import it.
    if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ:
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1; "
                           "set it in the environment to run the Triton kernels on CPU tensors")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# CI: few examples, the same ones every run; thorough: many fresh ones, for hunting locally.
settings.register_profile("default", max_examples=12, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.load_profile("default")


def pytest_configure(config):
    # Triton's interpreter (3.6) trips numpy's 1-element-array deprecation on every launch: noise, not ours.
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The engine's tensors are tiny: on a small shared box, OpenMP barriers between threads cost
    far more than the math (a [10, 64] x [64, 256] float64 matmul: ~20 us on 1 thread, up to ms on
    2). Module scope, so it is in force before any module-scoped run fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reports_a_step_late(monkeypatch):
    """Call it to make every reporter built after in the test read each step's rows at the end of
    the next, as on CUDA."""
    from kvcanary.runtime import reporting

    init = reporting.Reporter.__init__

    def lagged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.lag = 1

    return lambda: monkeypatch.setattr(reporting.Reporter, "__init__", lagged)


@pytest.fixture
def as_on_cuda(monkeypatch, reports_a_step_late):
    """Call it to run the reference engine built after in the test as it runs on CUDA: every
    reporter reads each step's rows at the end of the next, and decode batches hand their token
    truth as appends (``EngineConfig.truth_appends``' CUDA default)."""
    from kvcanary.engine.config import EngineConfig

    def apply():
        reports_a_step_late()
        monkeypatch.setattr(EngineConfig, "appends_truth",
                            property(lambda self: True if self.truth_appends is None else self.truth_appends))
    return apply
