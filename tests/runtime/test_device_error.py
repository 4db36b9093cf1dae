"""A kernel's device error flag reaches the operator: an ERROR line under log (and the workspaces
are reset, so the next forward is whole again), DeviceError under raise and recompute."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.errors import DeviceError
from kvcanary.ops._common import HAS_TRITON
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")]

i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731


def forward(canary: Canary, step: int):
    rtt = torch.arange(1, 33, dtype=torch.int32).view(4, 8)
    batch = ForwardBatch(i64(1, 2), i64(step, step), i64(1, 1), rtt, i64(5, 6), i64(step, step),
                         i64(9 + step, 17 + step))
    with canary.forward(batch):
        pass
    return canary.end_step(step)


def fused_canary(policy: Policy) -> Canary:
    return Canary(CanaryConfig(policy=policy, fused=True, truth=False, max_bs=4, max_tokens=64, sweep_interval=0),
                  PoolGeometry(num_slots=32, rows=4, max_ctx=8))


def test_log_policy_logs_the_flag_resets_the_workspace_and_goes_on(caplog):
    canary = fused_canary(Policy.LOG)
    assert forward(canary, 0).device_flags == 0
    canary.state.workspaces[0].sync[1] = 9  # a pre-phase count no launch of this grid reaches
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        report = forward(canary, 1)
    assert report.device_flags == 4 and canary.totals.device_errors == 1
    assert any("kv_canary device error: step=1 flags=workspace" in r.message for r in caplog.records)
    assert canary.state.workspaces[0].sync.tolist() == [0, 0, 0, 0] and int(canary.state.error[0]) == 0
    assert forward(canary, 2).device_flags == 0  # whole again


@pytest.mark.parametrize("policy", [Policy.RAISE, Policy.RECOMPUTE])
def test_raise_and_recompute_fail_loudly(policy):
    canary = fused_canary(policy)
    forward(canary, 0)
    canary.state.workspaces[1].sync[0] = -3  # TAIL's tickets start negative
    with pytest.raises(DeviceError, match="flags=workspace"):
        forward(canary, 1)


def test_no_flag_without_a_stale_workspace():
    canary = fused_canary(Policy.RAISE)
    for step in range(3):
        assert forward(canary, step).device_flags == 0
    assert canary.totals.device_errors == 0


def test_flush_reads_the_flag_of_the_last_forward():
    canary = fused_canary(Policy.LOG)
    forward(canary, 0)
    canary.state.workspaces[0].sync[1] = 9
    rtt = torch.arange(1, 33, dtype=torch.int32).view(4, 8)
    with canary.forward(ForwardBatch(i64(1, 2), i64(1, 1), i64(1, 1), rtt, i64(5, 6), i64(1, 1), i64(10, 18))):
        pass
    assert canary.flush(1).device_flags == 4 and canary.totals.device_errors == 1
