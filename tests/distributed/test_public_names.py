"""The public names of ``kvcanary.distributed`` are pinned; the signal op is the one in ops."""

from __future__ import annotations

import kvcanary.distributed
from kvcanary.ops import signal

NAMES = ["DIVERGENCE_RE", "AgreedStepReport", "Cause", "RankAgreement", "RankDivergence", "RankSignal",
         "RanksOutOfStep", "SignalBuffers", "chain_digest", "find_divergences", "signal_row"]


def test_distributed_names_are_pinned():
    assert kvcanary.distributed.__all__ == NAMES
    assert all(getattr(kvcanary.distributed, n) is not None for n in NAMES)
    assert kvcanary.distributed.signal_row is signal.signal_row
    assert kvcanary.distributed.SignalBuffers is signal.SignalBuffers
