"""An eager forward's HEAD and TAIL from the canary's buckets (``CanaryConfig.eager_graphs``) find
what its bound launches find. The workload runs once with the option and once without, for every
injector (and on CUDA every zoo bug too): the same violations (step, slot, launch point, reasons;
as a multiset: on a GPU the rows of one launch come in any order), the same tokens delivered at
the same steps, the damage detected, and eager forwards taken by the buckets. Where the damage
itself races on a GPU (two programs writing one slot: which record survives is unspecified, and
so are the re-detections that follow; two runs without the option differ there too, with the
same count of violations, the same verdict, and tokens delivered at the same steps, whose values
may differ where they were sampled from a raced slot), the verdict is compared instead: detected,
where and when first, at which injection; and the deliveries by step, request and index. On CUDA, with
graph-captured decode, the buckets replay graphs; on the CPU (slow: the Triton kernel
interpreted, a smaller workload) they launch their bound checks over their buffers."""

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

CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WHERE = [pytest.param("cuda", marks=CUDA),
         pytest.param("cpu", marks=[pytest.mark.slow, pytest.mark.skipif(
             torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case replays the graphs)")])]
# where two runs without the option already differ on the H100 (the same count, verdict and delivery steps;
# prefix_page_off_by_one: the same violations, and a token sampled after two writes into one slot differs)
RACES_ON_A_GPU = {"write_target_duplicate", Bug.STALE_RADIX_NODE, Bug.ABORT_INFLIGHT_WRITE, Bug.CHUNK_POSITIONS_RESTART,
                  Bug.PREFIX_PAGE_OFF_BY_ONE}
ON_CUDA = dict(device="cuda", cuda_graph=True, graph_batch_sizes=(1, 2, 4, 8, 16))


def _placed(setup, graphs: bool, where: str):
    """``setup`` on CUDA with graph-captured decode, or on the CPU with the Triton kernel; the option set."""
    canary = dataclasses.replace(setup.canary, eager_graphs=graphs, fused=True if where == "cpu" else None)
    engine = dataclasses.replace(setup.engine, **ON_CUDA) if where == "cuda" else setup.engine
    return dataclasses.replace(setup, engine=engine, canary=canary)


def _run(setup, make_fault, graphs: bool, where: str):
    fault = make_fault()
    run = drive(_placed(setup, graphs, where), [fault])
    violations = [v for r in run.hooks.reports for v in r.violations] + run.final
    replays = sum(c.route.eager.replays for c in (run.hooks.canary, run.hooks.window_canary)
                  if c is not None and c.route.eager is not None)
    return (sorted((v.step, v.slot, v.point.name, int(v.reasons)) for v in violations),
            sorted(tuple(d) for d in run.engine.delivery.log), replays, judge(fault, fault.injections, violations))


def _verdict(judged) -> tuple:
    return (judged.injected, judged.detected, judged.injection_step, judged.slot, judged.first_detection,
            judged.steps_to_detection)


def _assert_same(setup, make_fault, where: str = "cuda", injected: bool = True, racy: bool = False) -> None:
    """``injected``: the fault must have acted (a smaller workload may give some none to act on);
    ``racy``: its damage races on a GPU (module doc)."""
    found, delivered, replays, judged = _run(setup, make_fault, True, where)
    want_found, want_delivered, none, want_judged = _run(setup, make_fault, False, where)
    assert judged.detected if judged.injected else not injected, judged
    if racy:  # what a read of a raced slot samples races too: the same tokens delivered when, not their values
        assert _verdict(judged) == _verdict(want_judged)
        delivered, want_delivered = [d[:3] for d in delivered], [d[:3] for d in want_delivered]
    else:
        assert found == want_found and (found or not judged.injected)
    assert delivered and delivered == want_delivered
    assert replays > 0 and none == 0


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_is_found_alike_with_eager_graphs(name, where):
    make = lambda: FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.3, seed=3,  # noqa: E731
                                warmup_steps=8, max_injections=3)
    requests = 32 if where == "cuda" else 8  # interpreted: a smaller workload
    _assert_same(small_setup(requests, real_kv=FingerprintMode.PARTIAL), make, where, injected=where == "cuda",
                 racy=where == "cuda" and name in RACES_ON_A_GPU)


ZOO_CANARY = CanaryConfig(real_kv=FingerprintMode.PARTIAL, sweep_interval=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_a_zoo_bug_is_found_alike_with_eager_graphs(bug):
    case = {c.bug: c for c in zoo_cases(ModelConfig(), ZOO_CANARY, WorkloadConfig(num_requests=32))}[bug]
    _assert_same(case.setup, lambda: ZooTracker(bug), racy=bug in RACES_ON_A_GPU)
