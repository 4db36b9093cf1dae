"""What every fault injector shares: the gate (warm-up, probability, budget), the record of what
it did, and the launch point and reasons the canary must report for it.

``FaultHooks`` calls a fault at these points of a step:

| method                         | when                                                            |
|--------------------------------|-----------------------------------------------------------------|
| ``before_forward(batch, step)``| after scheduling, before the canary's sweep and HEAD            |
| ``after_head(batch, step)``    | after the canary's HEAD, before the model writes K/V            |
| ``before_tail(batch, step)``   | after the model wrote K/V, before the canary's TAIL             |
| ``on_report(ids, tables, vs)`` | after the canary's TAIL and step report, with its violations    |
| ``after_forward(batch, step)`` | right after that, before sampling                               |
| ``on_offload`` / ``on_load``   | after K/V (and records) moved: injections follow their slots    |
| ``on_free(slots)``             | after slots returned to the allocator                           |

A fault acts in ``before_forward`` or ``after_forward`` (on a write the forward should make:
between ``after_head`` and ``before_tail``, never inside a CUDA-graph capture); the other calls
keep its injections' ``affected_slots`` current, so the violations the damage causes are told from false positives.

It acts on the engine only through its public objects (the pool's buffers and page table, the
requests, the prefix cache's listing) and never changes the engine's bookkeeping. Each decision
is logged on ``kvcanary.faults``: what it did (WARNING) or why it skipped (DEBUG).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvcanary.core.record import Half, LaunchPoint, Reason, format_reasons
from kvcanary.errors import ConfigError
from kvcanary.ops.fingerprint import PARTIAL_BYTES, FingerprintMode
from kvcanary.runtime.batch import ForwardBatch

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine
    from kvcanary.runtime.canary import Canary
    from kvcanary.runtime.reporting import Violation

log = logging.getLogger("kvcanary.faults")


@dataclass(frozen=True)
class Expectation:
    """The first violation a fault causes: at ``point``, with every bit of ``reasons`` set and no
    bit outside ``reasons | optional`` (optional bits depend on the checks enabled: token truth,
    fingerprints)."""

    point: LaunchPoint
    reasons: Reason
    optional: Reason = Reason(0)

    def is_met_by(self, v: Violation) -> bool:
        bits, allowed = int(v.reasons), int(self.reasons | self.optional)
        return v.point is self.point and bits & self.reasons == self.reasons and not bits & ~allowed

    def describe(self) -> str:
        """``"chain @ HEAD"``: the reasons that must be set and the launch point."""
        return f"{format_reasons(self.reasons)} @ {self.point.name}"


@dataclass(eq=False)
class Injection:
    """One act of a fault: the step and slot it acted on, and every slot whose check it can break
    (to tell its violations from false positives). The damage travels: slots offloaded to the
    host tier and loaded back elsewhere join ``affected_slots``, and so do slots whose chain check
    failed because their predecessor is affected (``follow_violations``)."""

    fault: str
    step: int
    slot: int
    detail: str
    affected_slots: set[int] = field(default_factory=set)
    affected_host_rows: set[int] = field(default_factory=set)

    def explains(self, v: Violation) -> bool:
        return v.step >= self.step and v.slot in self.affected_slots

    def follow_violations(self, request_ids: Sequence, tables: torch.Tensor, violations: list[Violation]) -> None:
        """Add the slots of ``violations`` whose predecessor, in the page table of a request that
        read them (``tables[i]``: the row of ``request_ids[i]`` during the forward), is affected:
        a damaged record breaks its successors' links."""
        index = {rid: i for i, rid in enumerate(request_ids)}
        for v in violations:
            if v.step < self.step or v.slot in self.affected_slots:
                continue
            if any(rid in index and pos > 0 and int(tables[index[rid], pos - 1]) in self.affected_slots
                   for rid, pos in v.owners):
                self.affected_slots.add(v.slot)

    def follow_offload(self, device_slots: list[int], host_rows: list[int]) -> None:
        self.affected_host_rows |= {h for s, h in zip(device_slots, host_rows, strict=True) if s in self.affected_slots}

    def follow_load(self, host_rows: list[int], device_slots: list[int]) -> None:
        self.affected_slots |= {s for h, s in zip(host_rows, device_slots, strict=True) if h in self.affected_host_rows}


class Fault:
    """Base of the injectors. ``probability``: chance to act at each step that passed the gate;
    ``seed``: its random choices; ``warmup_steps``: steps before it may act; ``max_injections``:
    how many times it acts in all (0 = no limit)."""

    name: ClassVar[str]
    expected: ClassVar[Expectation]

    def __init__(self, *, probability: float = 1.0, seed: int = 0, warmup_steps: int = 0, max_injections: int = 1):
        if not 0.0 <= probability <= 1.0:
            raise ConfigError(f"{type(self).__name__} probability must be in [0, 1], got {probability}")
        if warmup_steps < 0 or max_injections < 0:
            raise ConfigError(f"{type(self).__name__} warmup_steps and max_injections must be >= 0, "
                              f"got {warmup_steps}, {max_injections}")
        self.probability, self.warmup_steps, self.max_injections = probability, warmup_steps, max_injections
        self.rng = random.Random(seed)
        self.injections: list[Injection] = []
        self.engine: Engine | None = None
        self.canary: Canary | None = None

    def attach(self, engine: Engine, canary: Canary | None = None) -> None:
        self.engine, self.canary = engine, canary

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        """Act before the canary's sweep and HEAD of ``step`` (default: nothing)."""

    def after_head(self, batch: ForwardBatch, step: int) -> None:
        """Act after the canary's HEAD of ``step``, before the model writes (default: nothing)."""

    def before_tail(self, batch: ForwardBatch, step: int) -> None:
        """Act after the model wrote K/V in ``step``, before the canary's TAIL (default: nothing)."""

    def after_forward(self, batch: ForwardBatch, step: int) -> None:
        """Act after the canary's TAIL of ``step`` (default: nothing)."""

    def on_report(self, request_ids: Sequence, tables: torch.Tensor, violations: list[Violation]) -> None:
        """The violations the canary reported for a forward, with the page-table rows its requests
        had (``tables[i]`` for ``request_ids[i]``): injections follow broken links."""
        for inj in self.injections:
            inj.follow_violations(request_ids, tables, violations)

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """K/V moved to the host tier: damaged slots carry their damage to the host rows."""
        if self.injections:
            slots, rows = device_slots.tolist(), host_rows.tolist()
            for inj in self.injections:
                inj.follow_offload(slots, rows)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        """K/V loaded back from the host tier: damaged host rows carry their damage to the slots."""
        if self.injections:
            rows, slots = host_rows.tolist(), device_slots.tolist()
            for inj in self.injections:
                inj.follow_load(rows, slots)

    def on_free(self, slots: torch.Tensor) -> None:
        """Slots returned to the allocator (default: nothing)."""

    # --- helpers for subclasses ----------------------------------------------------------------

    def is_armed(self, step: int) -> bool:
        """The gate: past the warm-up, under the budget, and the coin came up."""
        if step < self.warmup_steps:
            return False
        if self.max_injections and len(self.injections) >= self.max_injections:
            return False
        return self.rng.random() < self.probability

    def skip(self, step: int, why: str) -> None:
        log.debug("fault %s: step=%d skipped: %s", self.name, step, why)

    def record(self, step: int, slot: int, detail: str, affected: set[int]) -> Injection:
        inj = Injection(self.name, step, slot, detail, {s for s in affected | {slot} if s > 0})
        self.injections.append(inj)
        self.record_log(step, inj)
        return inj

    def record_log(self, step: int, inj: Injection) -> None:
        log.warning("fault %s: step=%d slot=%d %s", self.name, step, inj.slot, inj.detail)

    def batch_requests(self, batch: ForwardBatch) -> list[tuple[int, int, int, int]]:
        """(index in batch, request id, prefix_len, extend_len) of every real request of ``batch``."""
        prefix, extend = batch.prefix_lens.tolist(), batch.extend_lens.tolist()
        rows = batch.req_pool_indices.tolist()
        return [(i, rid, prefix[i], extend[i]) for i, rid in enumerate(batch.request_ids or ()) if rows[i] > 0]


def kv_row_bytes(engine: Engine, layer: int, half: Half, slot: int) -> torch.Tensor:
    """uint8 view of one slot's row of a layer's K or V buffer (shares storage: writes land in the pool)."""
    buffers = engine.pool.k_buffers if half is Half.K else engine.pool.v_buffers
    return buffers[layer][slot].view(-1).view(torch.uint8)


def flip_bit(engine: Engine, layer: int, half: Half, slot: int, byte: int, bit: int) -> tuple[int, int]:
    """XOR one bit of a slot's K or V row in place; returns the byte's value before and after."""
    row = kv_row_bytes(engine, layer, half, slot)
    before = int(row[byte])
    row[byte] = before ^ (1 << bit)
    return before, int(row[byte])


def pick_target(fault: Fault) -> tuple[int, Half, int, int]:
    """(layer, half, byte, bit) inside the bytes the canary fingerprints: a covered source (layer 0
    K without a canary), the low byte of one element, a low mantissa bit (the value stays finite)."""
    canary = fault.canary
    sources = canary.sources if canary is not None else []
    layer, half = (sources[0].layer, sources[0].half) if sources else (0, Half.K)
    if len(sources) > 1:
        src = fault.rng.choice(sources)
        layer, half = src.layer, src.half
    buffer = fault.engine.pool.k_buffers[layer]
    elem = buffer.element_size()
    slot_bytes = buffer[0].numel() * elem
    is_all = canary is not None and canary.config.real_kv is FingerprintMode.ALL
    span = slot_bytes if is_all else min(PARTIAL_BYTES, slot_bytes)
    byte = fault.rng.randrange(span // elem) * elem
    return layer, half, byte, fault.rng.randrange(min(6, 8 * elem - 2))


class RequestFault(Fault):
    """A fault aimed at one request: ``request_id`` (None: any request it finds a target in)."""

    def __init__(self, *, request_id: int | None = None, **gate):
        super().__init__(**gate)
        self.request_id = request_id

    def aims_at(self, request_id: int) -> bool:
        return self.request_id in (None, request_id)
