"""Prefill side corrupts after its last check: the K/V changes between the prefill engine's TAIL
and the transfer read.

Right before the transfer reads a finished prefill's slots (after the prefill engine's last
check of them), one fingerprinted bit of one slot flips in the prefill pool, as a write racing
the transfer would; the race ends before the prefill side looks again (the bit is restored
after the read), so only the copy carries the damage. The decode engine verifies the landed
slots at once (SWEEP): the fingerprint no longer matches the record that travelled with it.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.pd import TransferPayload
from kvcanary.faults._transfer import TransferFault
from kvcanary.faults.base import Expectation, flip_bit, pick_target


class PrefillAfterCheck(TransferFault):
    name = "prefill_after_check"
    expected = Expectation(LaunchPoint.SWEEP, Reason.FINGERPRINT)

    def __init__(self, **gate):
        super().__init__(**gate)
        self._flip: tuple[int, int, tuple] | None = None  # (row, prefill slot, flip target)
        self._landing: tuple[TransferPayload, int, str] | None = None

    def before_send(self, slots: torch.Tensor) -> None:
        if not self.is_armed(self.step):
            return
        layer, half, byte, bit = pick_target(self)
        row = self.rng.randrange(slots.numel())
        slot = int(slots[row])
        flip_bit(self.prefill, layer, half, slot, byte, bit)
        self._flip = (row, slot, (layer, half, byte, bit))

    def after_send(self, payload: TransferPayload) -> None:
        if self._flip is None:
            return
        row, slot, target = self._flip
        self._flip = None
        flip_bit(self.prefill, target[0], target[1], slot, target[2], target[3])  # the race ends: bytes restored
        layer, half, byte, bit = target
        self._landing = (payload, row, f"prefill slot {slot} layer {layer} {half.name} byte {byte} bit {bit} "
                                       f"flipped after its last check, during the transfer read")

    def after_receive(self, payload: TransferPayload, dst: torch.Tensor) -> None:
        if self._landing is None or self._landing[0] is not payload:
            return
        _, row, what = self._landing
        self._landing = None
        slot = int(dst[row])
        self.record(self.step, slot, f"request={payload.request_id} {what}; landed in slot {slot}", {slot})
