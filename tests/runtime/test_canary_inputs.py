"""The Canary names the limit a batch breaks, before any launch."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.errors import InputError
from kvcanary.ops._common import HAS_TRITON
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry


def test_a_batch_larger_than_max_bs_is_refused_with_the_limit_named():
    canary = Canary(CanaryConfig(max_bs=2), PoolGeometry(num_slots=32, rows=4, max_ctx=8))
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    rtt = torch.arange(1, 33, dtype=torch.int32).view(4, 8)
    batch = ForwardBatch(i64(1, 2, 3), i64(0, 0, 0), i64(1, 1, 1), rtt, i64(5, 6, 7), i64(0, 0, 0), i64(1, 9, 17),
                         truth_ids=i64(5, 6, 7), truth_offsets=i64(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"batch size 3 > CanaryConfig.max_bs \(2\); raise max_bs"):
        canary.head(batch)
    assert int(canary.state.stats.sum()) == 0 and canary.totals.forwards == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (tests/ops/test_bound_check.py on CUDA)")
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided positions"])
def test_a_batch_the_bound_launch_refuses_is_named_by_check_forward(strided):
    """The fused (Triton) HEAD launches through its bound check; a batch layout it does not take
    (positions every other element of a buffer) goes to check_forward, which names it before
    anything is written. The contiguous twin is stamped with no violation."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    canary = Canary(CanaryConfig(fused=True, truth=False, max_bs=4, max_tokens=16, sweep_interval=0),
                    PoolGeometry(num_slots=32, rows=4, max_ctx=8))
    assert canary.route.bound is not None
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    rtt = torch.arange(1, 33, dtype=torch.int32).view(4, 8)
    positions = torch.zeros(4, dtype=torch.int64)[::2] if strided else i64(0, 0)
    batch = ForwardBatch(i64(1, 2), i64(0, 0), i64(1, 1), rtt, i64(5, 6), positions, i64(1, 9))
    records = canary.state.records.clone()
    if strided:
        with pytest.raises(InputError, match="positions must be contiguous"):
            canary.head(batch)
        assert canary.state.records.equal(records)
    else:
        canary.head(batch)
        canary.tail(batch)
        assert canary.end_step(0).violations == []
        assert not canary.state.records.equal(records)  # stamped
