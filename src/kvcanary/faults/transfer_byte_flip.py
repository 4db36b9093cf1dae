"""Transfer byte flip: one bit of the K/V changes in flight between the prefill and decode engines.

After the prefill engine's K/V (and records) were read into host memory, one bit of one
fingerprinted row flips there, as a bad link or a buggy staging copy would do. The decode
engine verifies every received slot as it lands (SWEEP): the slot's fingerprint no longer
matches the record that travelled with it. The prefill side's copy is intact: it stays silent.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.pd import TransferPayload
from kvcanary.faults._transfer import TransferFault
from kvcanary.faults.base import Expectation


class TransferByteFlip(TransferFault):
    name = "transfer_byte_flip"
    expected = Expectation(LaunchPoint.SWEEP, Reason.FINGERPRINT)

    def __init__(self, **gate):
        super().__init__(**gate)
        self._flipped: tuple[TransferPayload, int, str] | None = None

    def after_send(self, payload: TransferPayload) -> None:
        if self.is_armed(self.step):
            row, what = self.flip_payload_bit(payload)
            self._flipped = (payload, row, what)

    def after_receive(self, payload: TransferPayload, dst: torch.Tensor) -> None:
        if self._flipped is None or self._flipped[0] is not payload:
            return
        _, row, what = self._flipped
        self._flipped = None
        slot = int(dst[row])
        self.record(self.step, slot, f"request={payload.request_id} {what} flipped in flight; landed in slot {slot}",
                    {slot})
