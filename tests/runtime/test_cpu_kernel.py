"""The compiled CPU kernel inside the runtime (what ``CanaryConfig.fused=None`` picks on the CPU
where numba serves), driven by the reference engine: the same records and counters as the
op-by-op torch path on a clean run (sweeps, offload and load-back included), and every fault of
the campaign judged exactly as on the op-by-op path (reasons, launch point, steps to detection)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.faults import FAULTS
from kvcanary.faults.judge import judge, select_faults
from kvcanary.ops.backend import Backend, cpu_kernels_usable
from kvcanary.runs.single import run_once

from ._helpers import small_setup

pytestmark = [pytest.mark.skipif(not cpu_kernels_usable(), reason="numba does not serve here"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the runtime runs on it")]


def test_clean_run_leaves_the_same_records_as_the_op_by_op_path():
    kernel, plain = run_once(small_setup(fused=None)), run_once(small_setup(fused=False))
    assert kernel.hooks.canary.backend is Backend.NUMBA and not plain.hooks.canary.fused
    assert kernel.violations == [] and plain.violations == []
    assert kernel.error is None and plain.error is None
    assert kernel.hooks.canary.state.records.equal(plain.hooks.canary.state.records)
    kc, pc = kernel.hooks.canary.counters(), plain.hooks.canary.counters()
    for point in ("HEAD", "TAIL", "SWEEP"):
        assert kc[point] == pc[point], point
    assert kc["HEAD"]["stamped"] > 0 and kc["TAIL"]["checked"] > 0 and kc["SWEEP"]["checked"] > 0


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_gets_the_verdict_of_the_op_by_op_path(name):
    verdicts = []
    for fused in (None, False):
        (fault,) = select_faults([name], seed=0, warmup_steps=24)
        out = run_once(small_setup(fused=fused), [fault])
        verdicts.append(judge(fault, out.injections, out.violations))
    kernel, plain = verdicts
    assert kernel.injected, f"{name} never acted"
    assert kernel.detected, f"{name}: expected {kernel.expected}, got {kernel.first_detection}"
    assert kernel.false_positives == 0
    assert kernel == plain
