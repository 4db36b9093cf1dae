"""The Canary names the limit a batch breaks, before any launch."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
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
