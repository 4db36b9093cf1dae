"""Transfer into the wrong destination slot: two rows of a transfer land in each other's slot.

The decode engine allocates the destination slots and caches them in page-table order, but
the copy writes the K/V (and, travelling with it, the record) of position a into the slot of
position b and back, as a transfer with a stale or permuted destination index would. The
landed slots are verified in page-table order at once (SWEEP): the slot of position a holds
position b's record, so its chain link (and position) fail, and its successor's link fails.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.pd import TransferPayload
from kvcanary.faults._transfer import TransferFault
from kvcanary.faults.base import Expectation


class TransferWrongSlot(TransferFault):
    name = "transfer_wrong_slot"
    expected = Expectation(LaunchPoint.SWEEP, Reason.CHAIN, Reason.POSITION)

    def destination(self, payload: TransferPayload, dst: torch.Tensor) -> torch.Tensor:
        n = dst.numel()
        if n < 3 or not self.is_armed(self.step):
            return dst
        a, b = sorted(self.rng.sample(range(1, n), 2))  # not the first: landed slots are checked from it
        write = dst.clone()
        write[a], write[b] = dst[b], dst[a]
        affected = {int(dst[i]) for i in (a, b, a + 1, b + 1) if i < n}
        self.record(self.step, int(dst[a]), f"request={payload.request_id} positions {a} and {b} written to each "
                                            f"other's slot ({int(dst[b])} and {int(dst[a])})", affected)
        return write
