"""Sliding-window table entry repointed: a stale full-slot -> window-slot translation.

Hybrid models keep their sliding-window layers' K/V in a smaller window pool addressed through
a full-slot -> window-slot table; a stale entry after a cache rebuild (sglang#25889, #33656)
makes attention read another token's window K/V. Before HEAD, the entry of one prefix position
inside a request's window is pointed at another live window slot. The window pool's canary
translates through the same table, so its HEAD finds the slot's chain broken against its
predecessor (with position and, under token truth, verify_token when the slot holds another
position or token); the successor's link breaks too. The full pool is untouched.

Needs a model with sliding-window layers (``ModelConfig.window_layers``); elsewhere it never
acts and logs why.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault
from kvcanary.runtime.batch import ForwardBatch


class SlidingWindowLut(Fault):
    name = "sliding_window_lut"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN, Reason.POSITION | Reason.VERIFY_TOKEN)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        window = getattr(self.engine.pool, "window", None)
        if window is None:
            self.skip(step, "needs a model with sliding-window layers (the engine has no window table)")
            return
        table, rows = batch.req_to_token, batch.req_pool_indices.tolist()
        lut = window.translate(torch.arange(window.lut.numel()))
        choices = []
        for i, rid, prefix, _ in self.batch_requests(batch):
            others = {int(s) for j, r in enumerate(rows) if j != i and r > 0
                      for s in table[r, : int(batch.prefix_lens[j] + batch.extend_lens[j])].tolist()}
            # inside the window, after its first position (the predecessor is checked) and before the last
            lo = max(prefix - window.window, 0) + 1
            choices += [(i, rid, q) for q in range(lo, prefix - 1) if int(table[rows[i], q]) not in others
                        and int(table[rows[i], q + 1]) not in others]
        if not choices:
            self.skip(step, "needs a request whose window holds 3 positions no other request of the batch reads")
            return
        i, rid, q = self.rng.choice(choices)
        slot, succ = int(table[rows[i], q]), int(table[rows[i], q + 1])
        old = int(lut[slot])
        live = torch.nonzero(lut).flatten()
        targets = [int(lut[s]) for s in live.tolist() if int(lut[s]) != old and s != slot]
        if not targets:
            self.skip(step, "no other live window slot to point at")
            return
        new = self.rng.choice(targets)
        window.lut[slot] = new  # the device table the layers and the canary read; the allocator's mirror keeps `old`
        self.record(step, new, f"request={rid} position={q}: window table entry of slot {slot} repointed from "
                               f"window slot {old} to {new}", {int(lut[succ])})
