"""The fused path (one check_forward launch per HEAD and per TAIL, what runs on CUDA) inside the
runtime, driven by the reference engine on the CPU through the Triton interpreter: the same
records as the op-by-op path on a clean run, and every per-forward fault caught as expected."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.engine.workload import WorkloadConfig, builtin_workload
from kvcanary.faults.judge import judge, select_faults
from kvcanary.ops._common import HAS_TRITON
from kvcanary.runs.single import run_once

from ._helpers import small_setup

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the fused path runs on it: "
                                 "tests/e2e/test_cuda.py and tests/engine/test_cuda_graph.py")]

PER_FORWARD = ("page_table_repoint", "used_slot_flip", "stale_slot_reuse", "dropped_kv_write", "wrong_layer_write")


def fused_setup(fused: bool, num_requests: int = 5):
    setup = small_setup(num_requests=num_requests, fused=fused)
    return dataclasses.replace(setup, workload=builtin_workload(WorkloadConfig(num_requests=num_requests,
                                                                               max_new_tokens=6)))


def test_clean_run_leaves_the_same_records_as_the_op_by_op_path():
    fused, plain = run_once(fused_setup(True)), run_once(fused_setup(False))
    assert fused.hooks.canary.fused and not plain.hooks.canary.fused
    assert fused.violations == [] and plain.violations == []
    assert fused.error is None and plain.error is None
    assert fused.hooks.canary.state.records.equal(plain.hooks.canary.state.records)
    fc, pc = fused.hooks.canary.counters(), plain.hooks.canary.counters()
    for point in ("HEAD", "TAIL"):
        assert fc[point] == pc[point], point
    assert fc["HEAD"]["stamped"] > 0 and fc["TAIL"]["checked"] > 0


@pytest.mark.parametrize("name", PER_FORWARD)
def test_each_fault_is_detected_as_expected(name):
    (fault,) = select_faults([name], seed=0, warmup_steps=4)
    out = run_once(fused_setup(True), [fault])
    verdict = judge(fault, out.injections, out.violations)
    assert verdict.injected, f"{name} never acted"
    assert verdict.detected, f"{name}: expected {verdict.expected}, first detection {verdict.first_detection}"
    assert verdict.false_positives == 0
