"""Byte flip in a prefix-cache slot nobody reads (only a sweep can see it).

At a step that has a sweep, before the sweep, one bit is flipped inside the fingerprinted bytes
of a slot of an idle prefix-cache node (``Engine.prefix_cache_slots``: no running request reads
it). No forward reads the slot, so neither HEAD nor TAIL can see it; the sweep reports a
fingerprint mismatch (within one sweep when the budget covers the cached slots).
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault, flip_bit, pick_target
from kvcanary.runtime.batch import ForwardBatch


class CachedSlotFlip(Fault):
    name = "cached_slot_flip"
    expected = Expectation(LaunchPoint.SWEEP, Reason.FINGERPRINT)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if self.canary is None or not self.canary.sweep_due(step):
            return  # acts only right before a sweep
        if not self.is_armed(step):
            return
        runs = [r for r in self.engine.prefix_cache_slots() if r.slots.numel()]
        if not runs:
            self.skip(step, "the prefix cache holds no idle slot on the device")
            return
        run = self.rng.choice(runs)
        k = self.rng.randrange(run.slots.numel())
        slot = int(run.slots[k])
        layer, half, byte, bit = pick_target(self)
        before, after = flip_bit(self.engine, layer, half, slot, byte, bit)
        self.record(step, slot, f"cached position={run.start_position + k} layer={layer} half={half.name} "
                                f"byte={byte} bit={bit} 0x{before:02x}->0x{after:02x}", set())
