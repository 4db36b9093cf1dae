"""A token's K/V written into the wrong layer (a layer index off by one, a stale buffer pointer in
a per-layer table, a fused kernel that reuses one layer's output pointer).

Between the canary's HEAD and the model's writes of step k, the fault takes the K and V rows of
one slot the forward writes in layer ``from_layer`` (covered: a source of the canary), as HEAD
left them. Right before TAIL, layer ``from_layer``'s freshly written K/V of that slot lands in
layer ``to_layer`` (over that layer's own write) and layer ``from_layer``'s rows are put back as
HEAD left them: its write did not happen. TAIL finds HEAD's mark in ``from_layer``'s rows:
MISSED_WRITE. What ``to_layer`` now holds is valid-looking K/V of another layer: invisible by
design (nothing tells one layer's values from another's), and so is the whole fault when
``from_layer`` is not covered.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.errors import ConfigError
from kvcanary.faults.base import Expectation, RequestFault, kv_row_bytes
from kvcanary.faults.dropped_kv_write import covered_layer, is_capturing, pick_written
from kvcanary.runtime.batch import ForwardBatch


class WrongLayerWrite(RequestFault):
    """``from_layer``: whose write goes astray (None: a covered layer); ``to_layer``: where it
    lands (None: another layer of the full-attention pool)."""

    name = "wrong_layer_write"
    expected = Expectation(LaunchPoint.TAIL, Reason.MISSED_WRITE)

    def __init__(self, *, from_layer: int | None = None, to_layer: int | None = None, **gate):
        super().__init__(**gate)
        if from_layer is not None and from_layer == to_layer:
            raise ConfigError(f"WrongLayerWrite from_layer {from_layer} == to_layer; pick two different layers")
        self.from_layer, self.to_layer = from_layer, to_layer
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (from row, its bytes, to row)

    def _layers(self) -> tuple[int, int] | None:
        full = list(self.engine.model_config.full_layers)
        src = self.from_layer if self.from_layer is not None else covered_layer(self)[0]
        others = [layer for layer in full if layer != src]
        if self.to_layer is not None:
            others = [self.to_layer]
        if src not in full or not others or others[0] not in full or others[0] == src:
            return None
        return src, self.rng.choice(others)

    def after_head(self, batch: ForwardBatch, step: int) -> None:
        self._pending = []
        if is_capturing() or not self.is_armed(step):
            return
        target, layers = pick_written(self, batch), self._layers()
        if target is None or layers is None:
            self.skip(step, "no real request of the batch writes a slot" if target is None
                      else "the model has no second full-attention layer to write into")
            return
        rid, position, slot = target
        src, dst = layers
        for half in Half:
            row = kv_row_bytes(self.engine, src, half, slot)
            self._pending.append((row, row.clone(), kv_row_bytes(self.engine, dst, half, slot)))
        self.record(step, slot, f"request={rid} position={position}: layer {src}'s K/V lands in layer {dst}", set())

    def before_tail(self, batch: ForwardBatch, step: int) -> None:
        for row, after_head, dst in self._pending:
            dst.copy_(row)
            row.copy_(after_head)
        self._pending = []
