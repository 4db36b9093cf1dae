"""Rows that travel with K/V: a slot's record and its source-tag side word (``ROW_BYTES``), moved
wherever the engine copies the slot's K/V.

``export_rows`` / ``import_rows`` (a transfer: imported rows are verified at once), ``land_rows``
(written unverified), and a host mirror for a host offload tier (``attach_host_tier``):
``offload`` / ``load_back`` (verified at once), or ``row_pairs`` for an engine that moves K/V
rows with a batched copy of its own, which then reports the rows it landed (``rows_landed``).
Every call checks its slots and rows before anything is read or written. Rows that come from
another canary come with its layout signature (``runtime.signature``): ``import_rows`` and
``land_rows`` take the sender's, and a host mirror (``HostMirror``) carries the signature of the
canary that made it, so another canary adopts it only with an equal one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvcanary.core.record import POSITION, RECORD_BYTES, ROW_BYTES
from kvcanary.errors import ConfigError, KVCanaryError
from kvcanary.runtime.arguments import check_slots, outside
from kvcanary.runtime.context import CanaryContext
from kvcanary.runtime.forward import Forward
from kvcanary.runtime.signature import LayoutSignature
from kvcanary.runtime.sweeping import Sweeper

_SIDE_BYTES = ROW_BYTES - RECORD_BYTES
_MAX_HOST_ROWS = 2**40  # host tier rows: beyond any host memory (40 bytes a row)


def _position_of(row: torch.Tensor) -> int:
    """The position a host row (uint8[ROW_BYTES], on the host) of ``export_rows`` holds."""
    return int(row[8 * POSITION: 8 * POSITION + 8].numpy().view(np.int64)[0])


@dataclass(frozen=True)
class HostMirror:
    """A host tier's canary rows: ``rows`` uint8[num_rows, ROW_BYTES] on the host (row ``r`` travels
    with the K/V of host row ``r``) and the ``signature`` of the canary that made it (what the rows
    mean). ``Canary.host_mirror``; another canary adopts it with ``attach_host_tier(mirror)``."""

    rows: torch.Tensor
    signature: LayoutSignature


class Rows:
    """The travelling rows of one canary (see the module doc); the public methods are the
    Canary's, which documents them."""

    def __init__(self, ctx: CanaryContext, forward: Forward, sweeper: Sweeper, signature: LayoutSignature):
        self.ctx, self.state, self.forward, self.sweeper = ctx, ctx.state, forward, sweeper
        self.signature = signature
        self.mirror: HostMirror | None = None
        self.host_rows: torch.Tensor | None = None
        self._host_views: tuple | None = None  # CPU: numpy views of records, side words and host rows

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        self.forward.join()
        index = slots.to(self.state.device)
        tags = self.state.source_tags[index].view(torch.uint8).view(-1, _SIDE_BYTES)
        return torch.cat([self.state.records[index], tags], dim=1)

    def land(self, op: str, slots: torch.Tensor, rows: torch.Tensor, signature: LayoutSignature) -> None:
        """Rows of another canary (``signature``: the sender's) into ``slots``, unverified; refused
        before anything is written where the signatures differ or the rows are malformed."""
        self.signature.check(op, signature)
        self.write(slots, rows)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of this layout (checked by the caller) into ``slots``, unverified."""
        n = slots.numel()
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or tuple(rows.shape) != (n, ROW_BYTES):
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise KVCanaryError(f"rows must be uint8[{n}, {ROW_BYTES}] (one export_rows row per slot), got {got}; "
                                "pass what export_rows gave")
        self.forward.join()
        dev = self.state.device
        index, rows = slots.to(dev), rows.to(dev)
        self.state.records[index] = rows[:, :RECORD_BYTES]
        self.state.source_tags[index] = rows[:, RECORD_BYTES:].contiguous().view(torch.int64).view(-1)

    def import_(self, slots: torch.Tensor, rows: torch.Tensor, signature: LayoutSignature) -> None:
        self.land("import_rows", slots, rows, signature)
        self.landed_rows(slots, rows)

    def landed_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        # rows on the host: the first landed position read there (the same bytes), not from the device
        self.landed(slots, _position_of(rows[0]) if len(rows) and not rows.is_cuda else None)

    def landed(self, slots: torch.Tensor, first_position: int | None) -> None:
        """Rows just written into ``slots``: their incidents close, and they are verified at once."""
        self.ctx.incidents.note(self.ctx.step.step, slots, "rewritten")
        self.sweeper.verify_landed(slots, first_position)

    def attach_host_tier(self, tier: int | HostMirror) -> None:
        records = self.state.records
        if isinstance(tier, HostMirror):
            self.check_mirror(tier)
            mirror = tier
        elif type(tier) is not int or not 1 <= tier <= _MAX_HOST_ROWS:
            raise ConfigError(f"attach_host_tier num_rows must be an int in [1, {_MAX_HOST_ROWS}] (host tier rows) "
                              f"or a HostMirror, got {tier!r}")
        else:
            mirror = HostMirror(torch.zeros(tier, ROW_BYTES, dtype=torch.uint8, pin_memory=records.is_cuda),
                                self.signature)
        self.mirror, self.host_rows = mirror, mirror.rows
        if not records.is_cuda:  # the CPU: offloads copy rows through numpy views, no torch call
            self._host_views = (records.numpy(), self.state.source_tags.numpy().view(np.uint8).reshape(-1, _SIDE_BYTES),
                                self.host_rows.numpy())

    def check_mirror(self, mirror: HostMirror) -> None:
        """A mirror another canary made may join this one only with the same layout, as host rows."""
        self.signature.check("attach_host_tier", mirror.signature)
        rows = mirror.rows
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] < 1 \
                or rows.shape[1] != ROW_BYTES or rows.device.type != "cpu" or not rows.is_contiguous():
            got = f"{rows.dtype}{list(rows.shape)} on {rows.device}" if isinstance(rows, torch.Tensor) else \
                type(rows).__name__
            raise KVCanaryError(f"attach_host_tier mirror.rows must be a contiguous uint8[num_rows, {ROW_BYTES}] "
                                f"tensor on the host, got {got}")

    def row_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        if self.host_rows is None:
            raise KVCanaryError("row_pairs() before attach_host_tier(): there is no host mirror to copy into; call "
                                "canary.attach_host_tier(num_host_rows) once after building the Canary")
        records, tags = self.state.records, self.state.source_tags.view(torch.uint8).view(-1, _SIDE_BYTES)
        return (records, self.host_rows[:, :RECORD_BYTES]), (tags, self.host_rows[:, RECORD_BYTES:])

    def rows_landed(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.check_host_move("rows_landed", device_slots, host_rows)
        if not self.ctx.config.enabled or not device_slots.numel():
            return
        t0 = time.perf_counter()
        self.landed(device_slots, _position_of(self.host_rows[int(host_rows[0])]))
        self.ctx.totals.seconds += time.perf_counter() - t0

    def offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.check_host_move("offload", device_slots, host_rows)
        if not self.ctx.config.enabled:
            return
        t0 = time.perf_counter()
        if self._host_views is not None and not device_slots.is_cuda and not host_rows.is_cuda:
            records, tags, host = self._host_views
            slots, rows = device_slots.numpy(), host_rows.numpy()
            moved = records[slots], tags[slots]  # both read before any row is written (a bad slot raises here)
            host[rows, :RECORD_BYTES], host[rows, RECORD_BYTES:] = moved
        else:
            self.host_rows[host_rows.cpu()] = self.export(device_slots).cpu()
        self.ctx.totals.seconds += time.perf_counter() - t0

    def load_back(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.check_host_move("load_back", device_slots, host_rows)
        if self.ctx.config.enabled:
            t0 = time.perf_counter()
            rows = self.host_rows[host_rows.cpu()]
            self.write(device_slots, rows)  # the mirror's layout is this canary's (checked when attached)
            self.landed_rows(device_slots, rows)
            self.ctx.totals.seconds += time.perf_counter() - t0

    def check_host_move(self, op: str, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        if self.host_rows is None:
            raise KVCanaryError(f"{op}() before attach_host_tier(): this canary has no host tier, so the records "
                                f"of offloaded slots would not travel and a load-back could not be verified; call "
                                f"canary.attach_host_tier(num_host_rows) once after building the Canary")
        for name, t in (("device_slots", device_slots), ("host_rows", host_rows)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise KVCanaryError(f"{op} {name} must be an int64[n] tensor, got {got}")
        if device_slots.shape != host_rows.shape:
            raise KVCanaryError(f"{op} device_slots length {device_slots.numel()} != host_rows length "
                                f"{host_rows.numel()}; pass one host row per slot")
        if outside(host_rows, self.host_rows.shape[0]):
            lo, hi = int(host_rows.min()), int(host_rows.max())
            raise KVCanaryError(f"{op} host_rows must be in [0, {self.host_rows.shape[0]}) (attach_host_tier "
                                f"num_rows), got values in [{lo}, {hi}]")
        check_slots(f"{op} device_slots", device_slots, self.state.num_slots, on_device=True)
