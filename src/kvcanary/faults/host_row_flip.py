"""Host-tier copy corruption: a byte of an offloaded row changes on the host before it comes back
(a bad DMA, host memory damage, a torn copy).

After TAIL of step k, one bit is flipped inside the fingerprinted bytes of a covered layer's K
or V in a host row that a waiting request will load back (see ``_host_tier``); its canary record
on the host is untouched. The load-back copies the damaged bytes into a device slot and the
canary verifies the landed slots at once (``Canary.load_back`` -> ``verify_landed``, tagged
SWEEP): the slot's fingerprint no longer matches its bytes. That is the first report, in the
step of the load-back, before the HEAD of the request that loaded it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.faults._host_tier import HostRowFault
from kvcanary.faults.base import Expectation, pick_target

if TYPE_CHECKING:
    from kvcanary.engine.radix import RadixNode


class HostRowFlip(HostRowFault):
    name = "host_row_flip"
    expected = Expectation(LaunchPoint.SWEEP, Reason.FINGERPRINT)

    def damage(self, step: int, targets: list[tuple[RadixNode, list[int]]]) -> None:
        node, rows = targets[0]  # the front-most waiting request loads it first
        k = self.rng.randrange(len(rows))
        row = rows[k]
        layer, half, byte, bit = pick_target(self)
        pool = self.engine.pool
        data = (pool.host_k if half is Half.K else pool.host_v)[layer, row].view(-1).view(torch.uint8)
        before = int(data[byte])
        data[byte] = before ^ (1 << bit)
        self.record_rows(step, f"host_row={row} (position {node.start + k}) layer={layer} half={half.name} "
                               f"byte={byte} bit={bit} 0x{before:02x}->0x{int(data[byte]):02x}", {row}, {row})
