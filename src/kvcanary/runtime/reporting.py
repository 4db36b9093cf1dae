"""One reporting pipeline: device ring -> asynchronous snapshot -> decode into ``Violation``.

Every step the ring counter and the stats table are copied (non-blocking, into pinned host
memory on CUDA) right after the step's checks; the copy is read at the next step, so nothing
on the hot path waits. Only rows appended since the last read are fetched, and only when there
are some. On the CPU the copy is synchronous and read in the same step. The ring fills once;
after every row of a full ring was read, the counter is reset right behind the next snapshot
(no launch sits between the two), so the total stays exact and ``dropped`` counts rows lost
to a full ring.

The violation line is frozen; parse it with ``VIOLATION_RE``::

    kv_canary violation: step=12 tag=HEAD.FULL.K reason=chain+position slot=183 position=5 token=17
    expected_token=-1 stored=0x1f... expected=0x9a... requests=7@5,9@5

(one line; ``requests`` lists request@position pairs that read the slot, ``cache`` for an idle
prefix-cache slot, empty when no owner is known). For a fingerprint failure the tag's half is
that of the first KV source whose part of the fingerprint differs, and ``Violation.sources``
lists every differing source's (layer, half); the JSON carries them as ``layer`` and ``sources``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcanary.core.record import (
    NUM_STATS,
    STAT_LAUNCHES,
    Half,
    LaunchPoint,
    LaunchTag,
    PoolKind,
    Reason,
    ViolationRow,
    decode_rows,
    format_reasons,
)
from kvcanary.runtime.snapshots import CopyRows, Publication

VIOLATION_RE = re.compile(
    r"^kv_canary violation: step=(?P<step>-?\d+) tag=(?P<tag>[A-Z]+\.[A-Z]+\.[KV]) reason=(?P<reason>[a-z_+]+) "
    r"slot=(?P<slot>-?\d+) position=(?P<position>-?\d+) token=(?P<token>-?\d+) "
    r"expected_token=(?P<expected_token>-?\d+) stored=(?P<stored>0x[0-9a-f]{16}) expected=(?P<expected>0x[0-9a-f]{16}) "
    r"requests=(?P<requests>[\w@,.-]*)$")
# the stats line (``Canary.stats_line``, every ``CanaryConfig.stats_period`` steps) and the watchdog line
STATS_RE = re.compile(
    r"^kv_canary stats: step=(?P<step>-?\d+) protected_tokens=(?P<protected_tokens>\d+) "
    r"verified_slots=(?P<verified_slots>\d+) sweeps=(?P<sweeps>\d+) violations=(?P<violations>\d+) "
    r"dropped=(?P<dropped>\d+) plan_overflows=(?P<plan_overflows>\d+)$")
WATCHDOG_RE = re.compile(
    r"^kv_canary watchdog: point=(?P<point>[A-Z]+) silent_steps=(?P<silent_steps>\d+) window=(?P<window>\d+) "
    r"checks stopped running$")
# the incident summary line (``runtime.incidents``, every ``CanaryConfig.incident_summary_steps`` steps with news)
INCIDENTS_RE = re.compile(
    r"^kv_canary incidents: step=(?P<step>-?\d+) open=(?P<open>\d+) incidents=(?P<incidents>\d+) "
    r"redetections=(?P<redetections>\d+) new_incidents=(?P<new_incidents>\d+) "
    r"new_redetections=(?P<new_redetections>\d+) closed=(?P<closed>\d+)$")


@dataclass(frozen=True)
class Violation:
    """A decoded violation mapped to the requests (and their positions) that read the slot."""

    step: int
    tag: LaunchTag
    reasons: Reason
    slot: int
    position: int
    token: int
    expected_token: int
    stored_value: int
    expected_value: int
    owners: tuple[tuple[object, int], ...] = ()  # (request id or "cache", position)
    sources: tuple[tuple[int, Half], ...] = ()  # (layer, half) of each KV source whose fingerprint part differs

    @property
    def point(self) -> LaunchPoint:
        return self.tag.point

    @property
    def layer(self) -> int | None:
        """The layer of the first differing KV source; None when no source is named."""
        return self.sources[0][0] if self.sources else None

    @property
    def requests(self) -> tuple:
        return tuple(r for r, _ in self.owners if r != "cache")

    def line(self, names: Mapping | None = None) -> str:
        """The frozen violation line; ``names`` (request id -> client id) names its requests."""
        names = names or {}
        owners = ",".join(f"{names.get(r, r)}@{p}" for r, p in self.owners)
        return (f"kv_canary violation: step={self.step} tag={self.tag} reason={format_reasons(self.reasons)} "
                f"slot={self.slot} position={self.position} token={self.token} "
                f"expected_token={self.expected_token} stored=0x{self.stored_value & (2**64 - 1):016x} "
                f"expected=0x{self.expected_value & (2**64 - 1):016x} requests={owners}")

    def to_json(self) -> dict:
        return {"step": self.step, "tag": str(self.tag), "launch_point": self.tag.point.name,
                "pool": self.tag.pool.name, "reasons": Reason.names(self.reasons), "slot": self.slot,
                "position": self.position, "token": self.token, "expected_token": self.expected_token,
                "stored_value": self.stored_value, "expected_value": self.expected_value,
                "requests": [{"request": r, "position": p} for r, p in self.owners], "layer": self.layer,
                "sources": [{"layer": layer, "half": half.name} for layer, half in self.sources]}


@dataclass
class StepMeta:
    """What the reporter keeps of a step to name the owners of its violation rows."""

    step: int
    batch: object | None = None  # the ForwardBatch of the step's forward
    sweep_slots: dict[int, int] = field(default_factory=dict)  # slot -> position, for sweep rows
    # what the step's sweeps checked, in order: each (slots, positions), int64 arrays, or a list of
    # int64 [4, n] entry blocks (slot, pred, position, token) of one sweep
    sweep_runs: list = field(default_factory=list)

    def sweep_position(self, slot: int) -> int | None:
        """The position a sweep of this step checked ``slot`` at (the latest sweep's), else None."""
        for checked in reversed(self.sweep_runs):
            pairs = ((b[0], b[2]) for b in reversed(checked)) if isinstance(checked, list) else (checked,)
            for slots, positions in pairs:
                hit = np.flatnonzero(slots == slot)
                if hit.size:
                    return int(positions[hit[-1]])
        return self.sweep_slots.get(slot)


def owners_of(meta: StepMeta, row: ViolationRow) -> tuple[tuple[object, int], ...]:
    """Requests of ``meta.batch`` whose page table holds ``row.slot`` (prefix or written tokens)."""
    if row.tag.point is LaunchPoint.SWEEP:
        pos = meta.sweep_position(row.slot)
        return (("cache", pos),) if pos is not None else ()
    b = meta.batch
    if b is not None and row.reasons & Reason.BAD_ENTRY:  # named by its page-table row (core.record)
        return _owners_by_row(b, row.stored_value, row.stored_position)
    if b is None or row.slot <= 0:
        return ()
    if row.reasons & (Reason.WRITE_CONFLICT | Reason.READ_CONFLICT):  # both requests, whatever their tables hold
        held = _owners_in_table(b, row)
        named = [*_owners_by_row(b, row.stored_value, row.stored_position),
                 *_owners_by_row(b, row.expected_value, -1)]
        have = {r for r, _ in held}
        return held + tuple(o for o in dict.fromkeys(named) if o[0] not in have)
    held = _owners_in_table(b, row)
    if row.reasons & _WRITE_REASONS:  # the writer, from the step's own write targets (the table may have moved on)
        held += tuple(o for o in _owners_written(b, row) if o not in held)
    return held


_WRITE_REASONS = Reason.WRITE_TOKEN | Reason.WRITE_POSITION | Reason.MISSED_WRITE


def _owners_written(b, row: ViolationRow) -> tuple[tuple[object, int], ...]:
    """The requests of batch ``b`` that wrote ``row.slot`` in the step, at their true positions.
    Read from the batch's own write targets, so a report a step late (CUDA) still names a writer
    whose request left, and whose page-table row was freed or reused, in between."""
    if row.tag.pool is not PoolKind.FULL:
        return ()  # window-pool slots are named through the table's lookup
    written = torch.nonzero(b.out_cache_loc.cpu() == row.slot).flatten()
    if not written.numel():
        return ()
    ext, rows = b.extend_lens.cpu(), b.req_pool_indices.cpu()
    ends = torch.cumsum(ext, 0)
    req = torch.searchsorted(ends, written, right=True)
    pos = b.prefix_lens.cpu()[req] + written - (ends - ext)[req]
    ids = b.request_ids or tuple(range(b.batch_size))
    return tuple((ids[int(r)], int(p)) for r, p in zip(req.tolist(), pos.tolist(), strict=True) if int(rows[r]) != 0)


def _owners_in_table(b, row: ViolationRow) -> tuple[tuple[object, int], ...]:
    rows = b.req_pool_indices.cpu()
    ends = (b.prefix_lens + b.extend_lens).cpu()
    width = int(ends.max()) if ends.numel() else 0
    if width == 0:
        return ()
    table = b.req_to_token[b.req_pool_indices, :width].cpu()
    if getattr(b, "slot_lut", None) is not None and row.tag.pool is not PoolKind.FULL:  # window-pool slots
        table = b.slot_lut.cpu()[table.to(torch.int64)]
    hit = (table == row.slot) & (torch.arange(width)[None, :] < ends[:, None]) & (rows[:, None] != 0)
    ids = b.request_ids or tuple(range(b.batch_size))
    return tuple((ids[int(r)], int(p)) for r, p in torch.nonzero(hit).tolist())


def _owners_by_row(b, table_row: int, position: int) -> tuple[tuple[object, int], ...]:
    """The request of batch ``b`` on page-table row ``table_row`` (never the padding row 0)."""
    if table_row <= 0:
        return ()
    ids = b.request_ids or tuple(range(b.batch_size))
    hit = torch.nonzero(b.req_pool_indices.cpu() == table_row).flatten().tolist()
    return tuple((ids[i], position) for i in hit)


@dataclass(slots=True)  # one a step: slots make it cheaper to build and read
class _Snapshot:
    meta: StepMeta
    counter: torch.Tensor | np.ndarray | None  # CPU: the copies (the block's words, or the counter's);
    stats: torch.Tensor | None  # CUDA snapshots read their row instead
    event: object | None
    reset: bool
    row: int = -1  # CUDA copy: the pinned row it was copied into
    seq: int = -1  # CUDA replay: the publication that carries its counters


class Reporter:
    """Snapshots the ring counter, stats and error flags each step and decodes new rows one step
    later. On CUDA the three are read from preallocated pinned rows (``runtime.snapshots``): a
    replayed graph publishes them itself, an eager TAIL from its launch (``published``), else
    ``snapshot`` publishes them after eager forwards, and
    where the device cannot publish it copies them (one copy when ``block`` holds them back to
    back, as ``DeviceState.counter_block()``)."""

    def __init__(self, ring: torch.Tensor, counter: torch.Tensor, stats: torch.Tensor,
                 sources: tuple[tuple[int, Half], ...] = (), *, error: torch.Tensor | None = None,
                 block: torch.Tensor | None = None):
        self.ring, self.counter, self.stats, self.error, self.block = ring, counter, stats, error, block
        self._capacity = ring.shape[0]
        self.sources = tuple(sources)  # (layer, half) of the pool's KV sources, in the kernels' order
        self.is_cuda = ring.is_cuda
        self.lag = 1 if self.is_cuda else 0
        self._pending: deque[_Snapshot] = deque()
        self._read_upto = 0
        self._total_before = 0
        self._reset_next = False
        self.rows_read = 0
        self.latest_stats = torch.zeros_like(stats, device="cpu")
        self.latest_stats_view = self.latest_stats.numpy()  # the same memory, for reads without torch dispatch
        self.latest_total = 0
        self.flags_read = 0  # error flags of the snapshots read by the last ``collect`` (CUDA; OR-ed)
        self._side = torch.cuda.Stream(device=ring.device) if self.is_cuda else None
        self._copies = CopyRows(2 + stats.numel(), ring.device) if self.is_cuda else None
        # CPU: the counter block's words as numpy (a snapshot copies them without torch dispatch) and as
        # a memoryview, and the latest stats as one: ``read_host`` reads them with CPython's own code
        # (numpy's is cold after a model's forward: ~3 µs a call there against ~0.1 µs in a loop)
        self._host_block = block.numpy() if block is not None and not self.is_cuda else None
        if self._host_block is not None:
            self._host_words = memoryview(self._host_block)
        # the latest stats as a memoryview, and a strided view of its launch words, a tag each, in tag
        # order (point p's tags are [per * p, per * (p + 1))): ``host_launches`` reads them in one call
        self._latest_words = memoryview(self.latest_stats_view.reshape(-1))
        self._launch_view = self._latest_words[STAT_LAUNCHES::NUM_STATS]
        per = stats.shape[0] // len(LaunchPoint)  # tags per launch point
        self.point_tags = tuple(  # each launch point's slice of ``host_launches``
            slice(per * p, per * (p + 1)) for p in range(len(LaunchPoint)))
        # ``counter | stats | error`` of the snapshot being read, copied here (CUDA): one buffer, reused
        self._read_words = memoryview(np.zeros(2 + stats.numel(), dtype=np.int64))
        self.publication: Publication | None = None  # set by ``start_publishing``
        self._unread = 0  # publications made since the last snapshot besides replays (``published``)

    def start_publishing(self) -> bool:
        """On CUDA with a counter block: let captured graphs publish their counters (``publish``);
        False (copies only) where the device cannot."""
        if not self.is_cuda or self.block is None:
            return False
        pub = Publication(self.block)
        self.publication = pub if pub.probe() else None
        return self.publication is not None

    def publish(self) -> None:
        """The launch a captured graph holds after TAIL (see ``runtime.snapshots``)."""
        self.publication.launch()

    def published(self) -> None:
        """A launch (an eager TAIL) published the counter block: the next snapshot counts it."""
        self._unread += 1

    def snapshot(self, meta: StepMeta, replays: int = 0, current: bool = False) -> None:
        """Enqueue this step's counters (never blocks): with a publication (CUDA,
        ``start_publishing``), ``replays`` graph replays since the last snapshot published them, or
        where ``current`` the last publication counted by ``published`` did (nothing launched
        since), or else this call publishes them now, behind the step's checks; without a
        publication they are copied now."""
        reset = self._reset_next
        pub = self.publication
        if pub is not None:
            pub.expected += self._published(replays, current)
            snap = _Snapshot(meta, None, None, None, reset, seq=pub.expected)
        elif self.is_cuda:
            snap = self._copy_cuda(meta, reset)
        elif self._host_block is not None:
            snap = _Snapshot(meta, self._host_block.copy(), None, None, reset)
        else:
            counter, stats = self.counter.clone(), self.stats.clone()
            snap = _Snapshot(meta, counter, stats, None, reset)
        self._pending.append(snap)
        if reset:
            # the next forward appends from row 0 again: the rows of every pending snapshot, this
            # step's included, are read now (with a lag they would be overwritten before their read;
            # on CUDA this waits for the step), and handed out when their lag is up, as always
            self._pending = deque(self._read_now(s) for s in self._pending)
            self.counter.zero_()
            self._reset_next = False

    def advance(self, meta: StepMeta, replays: int = 0, current: bool = False) -> list[Violation]:
        """``snapshot`` then ``collect``. A step whose snapshot a publication carries, behind one
        published snapshot and no counter restart (every clean step after the first), takes that
        snapshot's place in the queue and reads the one before it, in one call."""
        pub, pending = self.publication, self._pending
        if pub is not None and not self._reset_next and len(pending) == 1 and self.lag == 1:
            old = pending[0]
            if type(old) is _Snapshot and old.seq >= 0:
                if replays:  # ``_published`` of a step that replayed a graph, without its call
                    pub.expected += replays + self._unread
                    self._unread = 0
                else:
                    pub.expected += self._published(replays, current)
                self.flags_read = 0
                seq = pub.expected
                rows = self._read(old)
                old.meta, old.reset, old.seq = meta, False, seq  # read: the same object carries this step's
                return rows
        self.snapshot(meta, replays, current)
        return self.collect()

    def _published(self, replays: int, current: bool) -> int:
        """The publications this step adds: its ``replays`` (each graph published its counters) and
        the launches' (``published``), plus one launched now on the current stream unless a replay
        or, where ``current``, the last launch's carries the step's counters."""
        n, self._unread = replays + self._unread, 0
        if replays or (current and n):
            return n
        self.publication.launch()
        return n + 1

    def _read_now(self, snap: _Snapshot) -> tuple[list[Violation], int]:
        """A pending snapshot's violations and error flags, read ahead of ``collect``."""
        if isinstance(snap, tuple):
            return snap
        flags, self.flags_read = self.flags_read, 0
        rows = self._read(snap)
        flags, self.flags_read = self.flags_read, flags
        return rows, flags

    def read_host(self, meta: StepMeta) -> list[Violation]:
        """``snapshot`` then ``collect`` on the CPU (no lag: the step's counters are read at once),
        in one pass over the counter block's numpy view, copying nothing but the stats (and the
        rows, when there are new ones). Only where ``read_in_place``."""
        words = self._host_words
        total = words[0]
        self._latest_words[:] = words[1:-1]
        if self._reset_next:  # the counter restarts right behind this read
            self.counter.zero_()
            self._reset_next = False
            return self._rows(meta, total, True, stats_read=True)
        if total <= self._read_upto and total < self._capacity:  # nothing new, nothing to reset: a clean step
            self.latest_total = self._total_before + total
            return []
        return self._rows(meta, total, False, stats_read=True)

    def host_launches(self) -> list[int]:
        """Each tag's launches in the latest stats read (tag order), from one copy of the launch
        words (no numpy); ``point_tags`` slices it by launch point (``Watchdog.observe_tags``)."""
        return self._launch_view.tolist()

    @property
    def read_in_place(self) -> bool:
        """Whether ``read_host`` serves: a CPU reporter with a counter block, no lag (a test may
        give a CPU reporter the CUDA lag) and nothing pending."""
        return self._host_block is not None and self.lag == 0 and not self._pending

    def _copy_cuda(self, meta: StepMeta, reset: bool) -> _Snapshot:
        c = self._copies
        i = c.take()
        row = c.rows[i]
        if self.block is not None:
            row.copy_(self.block, non_blocking=True)
        else:
            row[:1].copy_(self.counter, non_blocking=True)
            row[1:-1].copy_(self.stats.view(-1), non_blocking=True)
            if self.error is not None:
                row[-1:].view(torch.int32)[:1].copy_(self.error, non_blocking=True)
        event = c.events[i]
        event.record()
        return _Snapshot(meta, None, None, event, reset, row=i)

    def collect(self, flush: bool = False) -> list[Violation]:
        """Decode the rows of every snapshot at least ``lag`` steps old (all when ``flush``)."""
        out = []
        self.flags_read = 0
        while self._pending and (flush or len(self._pending) > self.lag):
            snap = self._pending.popleft()
            if isinstance(snap, tuple):  # read ahead of a counter restart (``snapshot``)
                out += snap[0]
                self.flags_read |= snap[1]
            else:
                out += self._read(snap)
        return out

    def _words(self, snap: _Snapshot) -> memoryview:
        """A copied snapshot's ``ring_counter | stats | error`` words (waits for a step-old one), as
        a memoryview of int64 (on CUDA the reporter's one read buffer: use it before the next read);
        ``_read`` reads a published one itself."""
        if snap.row >= 0:
            snap.event.synchronize()  # a step old: already complete on the device
            self._read_words[:] = self._copies.words[snap.row]
            self._copies.free.append(snap.row)  # read: the next snapshot may reuse its row and event
            return self._read_words
        if snap.stats is None:  # the block's words, copied
            return memoryview(snap.counter)
        return memoryview(np.concatenate([snap.counter.numpy(), snap.stats.numpy().reshape(-1), [0]]))

    def _read(self, snap: _Snapshot) -> list[Violation]:
        if snap.seq >= 0:  # a published row (every step where the device publishes): read in place here
            words, seq, pub = self._read_words, snap.seq, self.publication
            w, k = pub.words, pub.width
            base = seq % pub.num_rows * k
            if w[base] == seq:  # arrived, as at every clean step: copied here, without ``read_into``'s call
                words[:] = w[base + 1: base + k]
            if w[base] != seq:  # not yet, or overwritten while copied: its wait and fallback
                pub.read_into(seq, words)
        else:
            words = self._words(snap)
        if self.is_cuda:  # the error flags: the int32 in the low half of the last word
            low = words[-1] & 0xFFFFFFFF
            if low:
                self.flags_read |= low - (1 << 32) if low >> 31 else low
        total = words[0]
        if total <= self._read_upto and total < self._capacity and not snap.reset:  # nothing new (``_rows``)
            self._latest_words[:] = words[1:-1]
            self.latest_total = self._total_before + total
            return []
        return self._rows(snap.meta, total, snap.reset, words)

    def _rows(self, meta: StepMeta, total: int, reset: bool, words: memoryview | None = None,
              stats_read: bool = False) -> list[Violation]:
        """Take in a snapshot of ``total`` rows ever appended and its stats (``words``; with
        ``stats_read`` they are in already): the new rows, decoded."""
        if not stats_read:
            self._latest_words[:] = words[1:-1]
        self.latest_total = self._total_before + total
        cap = self._capacity
        hi = min(total, cap)
        rows = []
        if hi > self._read_upto:
            if self._side is not None:  # the host saw the snapshot complete: the rows are written
                with torch.cuda.stream(self._side):
                    rows = decode_rows(self.ring[self._read_upto:hi])
            else:
                rows = decode_rows(self.ring[self._read_upto:hi])
            self.rows_read += len(rows)
            self._read_upto = hi
        if reset:
            self._total_before += total
            self._read_upto = 0
        elif total >= cap:
            self._reset_next = True
        return [Violation(meta.step, r.tag, r.reasons, r.slot, r.stored_position, r.stored_token,
                          r.expected_token, r.stored_value, r.expected_value, owners_of(meta, r),
                          self.differing_sources(r)) for r in rows] if rows else []

    def differing_sources(self, row: ViolationRow) -> tuple[tuple[int, Half], ...]:
        """(layer, half) of the sources named by the row's source mask (unknown indices skipped)."""
        return tuple(self.sources[i] for i in row.source_indices if i < len(self.sources))

    @property
    def dropped(self) -> int:
        return max(self.latest_total - self.rows_read, 0)
