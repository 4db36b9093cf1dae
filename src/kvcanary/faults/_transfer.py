"""What the prefill/decode transfer faults share: access to both engines and the transfer.

A transfer fault is a ``Fault`` of the decode engine (``FaultHooks`` gives it the decode engine
and its canary, and its steps count its gate) and a ``TransferHooks`` of the ``KVTransfer``
(``attach_transfer`` gives it the prefill engine and its canary). The damage is always judged
on the decode side; the prefill side must stay silent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcanary.core.record import Half
from kvcanary.engine.pd import KVTransfer, TransferHooks, TransferPayload
from kvcanary.faults.base import Fault, pick_target

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine
    from kvcanary.runtime.canary import Canary


class TransferFault(Fault, TransferHooks):
    def __init__(self, **gate):
        super().__init__(**gate)
        self.transfer: KVTransfer | None = None
        self.prefill: Engine | None = None
        self.prefill_canary: Canary | None = None

    def attach_transfer(self, transfer: KVTransfer) -> None:
        self.transfer, self.prefill, self.prefill_canary = transfer, transfer.prefill, transfer.prefill_canary

    @property
    def step(self) -> int:
        """The decode engine's step: the gate and the injections count in it."""
        return self.engine.step_index

    def flip_payload_bit(self, payload: TransferPayload) -> tuple[int, str]:
        """XOR one fingerprinted bit of one row of ``payload`` (host memory); returns (row, what)."""
        layer, half, byte, bit = pick_target(self)
        row = self.rng.randrange(len(payload.token_ids))
        kv = payload.k if half is Half.K else payload.v
        flat = kv[layer, row].view(-1).view(torch.uint8)
        flat[byte] ^= 1 << bit
        return row, f"layer {layer} {half.name} byte {byte} bit {bit} of position {row}"
