"""CUDA: an eager forward's HEAD and TAIL replayed from the canary's bucket graphs
(``CanaryConfig.eager_graphs``) find what its bound launches find. The workload runs on CUDA with
graph-captured decode, once with the option and once without, for every injector and every zoo
bug: the same violations (step, slot, launch point, reasons) in the same order, the same tokens
delivered at the same steps, the damage detected, and eager forwards replayed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import Bug
from kvcanary.faults import FAULTS
from kvcanary.faults.judge import judge
from kvcanary.faults.zoo_tracker import ZooTracker
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.campaign import zoo_cases

from ._helpers import drive, small_setup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ON_CUDA = dict(device="cuda", cuda_graph=True, graph_batch_sizes=(1, 2, 4, 8, 16))


def _on_cuda(setup, graphs: bool):
    engine = dataclasses.replace(setup.engine, **ON_CUDA)
    return dataclasses.replace(setup, engine=engine, canary=dataclasses.replace(setup.canary, eager_graphs=graphs))


def _run(setup, make_fault, graphs: bool):
    fault = make_fault()
    run = drive(_on_cuda(setup, graphs), [fault])
    violations = [v for r in run.hooks.reports for v in r.violations] + run.final
    replays = sum(c._eager.replays for c in (run.hooks.canary, run.hooks.window_canary)
                  if c is not None and c._eager is not None)
    return ([(v.step, v.slot, v.point.name, int(v.reasons)) for v in violations],
            sorted(tuple(d) for d in run.engine.delivery.log), replays, judge(fault, fault.injections, violations))


def _assert_same(setup, make_fault) -> None:
    found, delivered, replays, judged = _run(setup, make_fault, True)
    want_found, want_delivered, none, _ = _run(setup, make_fault, False)
    assert judged.injected and judged.detected, judged
    assert found and found == want_found
    assert delivered and delivered == want_delivered
    assert replays > 0 and none == 0


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_is_found_alike_with_eager_graphs(name):
    make = lambda: FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.3, seed=3,  # noqa: E731
                                warmup_steps=8, max_injections=3)
    _assert_same(small_setup(real_kv=FingerprintMode.PARTIAL), make)


ZOO_CANARY = CanaryConfig(real_kv=FingerprintMode.PARTIAL, sweep_interval=4)


@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_a_zoo_bug_is_found_alike_with_eager_graphs(bug):
    case = {c.bug: c for c in zoo_cases(ModelConfig(), ZOO_CANARY, WorkloadConfig(num_requests=32))}[bug]
    _assert_same(case.setup, lambda: ZooTracker(bug))
