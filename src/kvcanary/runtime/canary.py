"""Canary: the facade an engine calls around each forward.

    canary = Canary(CanaryConfig(), PoolGeometry(num_slots, rows, max_ctx), sources=[...])
    with canary.forward(batch):        # HEAD on enter, TAIL on exit
        model(batch)
    report = canary.end_step(step)     # reporting, policies, watchdog, stats line

HEAD: scatter the token truth, build the plan, verify the prefix (identity), stamp the written
slots. TAIL: verify the prefix again with fingerprints, record the written slots' fingerprints.
SWEEP: ``sweep(runs)`` verifies idle cached slots within the byte budget. Slots copied elsewhere
carry their records: ``export_rows`` / ``import_rows`` (rows of ``ROW_BYTES``: the record and its
source-tag side word), and ``offload`` / ``load_back`` keep a host mirror for a host tier
(``attach_host_tier`` first; load-back is verified at once); an engine that moves K/V rows with
a batched copy of its own moves the mirror's rows in it (``row_pairs``) and reports the rows it
landed (``rows_landed``). Violations are grouped into
incidents (``runtime.incidents``): the engine reports freed slots with ``slots_freed`` so that a
slot's incidents close when it is reused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcanary.config import CanaryConfig, Overlap, Policy
from kvcanary.core.record import (
    POSITION,
    RECORD_BYTES,
    ROW_BYTES,
    STAT_CHECKED,
    STAT_STAMPED,
    LaunchPoint,
    LaunchTag,
    PoolKind,
    Reason,
)
from kvcanary.errors import CanaryViolation, ConfigError, DeviceError, KVCanaryError
from kvcanary.ops.backend import HAS_TRITON, Backend, compile_cpu_kernels, cpu_kernels_usable
from kvcanary.ops.check import BatchMemo, BoundCheck, check_forward
from kvcanary.ops.conflicts import WriteMarks, check_writes
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import BoundMarks, check_writes_landed, mark_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import scatter_req_token_ids, scatter_validated
from kvcanary.ops.stamp import stamp
from kvcanary.ops.state import DeviceFlag, DeviceState
from kvcanary.ops.verify import BoundVerify, verify
from kvcanary.runtime.batch import BatchError, ForwardBatch
from kvcanary.runtime.cpu_forward import CpuForward
from kvcanary.runtime.eager_graphs import EagerGraphs
from kvcanary.runtime.incidents import Incident, IncidentTracker
from kvcanary.runtime.reporting import Reporter, StepMeta, Violation
from kvcanary.runtime.sweep import RunCache, SweepRun, same_blocks, sweep_entries
from kvcanary.runtime.sweep_graphs import SweepGraphs, staging_words
from kvcanary.runtime.warmup import warm_up
from kvcanary.runtime.watchdog import Watchdog, WatchdogAlarm

log = logging.getLogger("kvcanary")


class WatchdogTimeout(KVCanaryError):
    """A launch point stopped running (raised under the raise and recompute policies)."""


@dataclass(frozen=True)
class PoolGeometry:
    num_slots: int
    rows: int
    max_ctx: int
    device: str = "cpu"


@dataclass(frozen=True)
class Recovery:
    """What the recompute policy hands the engine: re-prefill these requests from their token
    history, dropping tokens produced at ``since_step`` or later, and quarantine these slots.

    ``since_step`` is the first step whose forward could have read or written the damage: the
    earliest step whose checks reported it. Every slot a forward reads is verified at its HEAD
    and again at its TAIL, write targets are checked at HEAD (conflicts, bad entries) and at TAIL
    (written at all: MISSED_WRITE; then fingerprinted), so damage is reported by the first
    forward that reads or writes it, in that forward's own report. On the CPU that report is
    read before the step samples (nothing to drop); on CUDA one step late, so an engine holds
    each token back until the report of its step was read (``kvcanary.engine.delivery``). Bad
    entries name no slot to quarantine."""

    requests: tuple
    slots: tuple[int, ...]
    since_step: int


@dataclass
class StepReport:
    step: int
    violations: list[Violation] = field(default_factory=list)
    alarms: list[WatchdogAlarm] = field(default_factory=list)
    recovery: Recovery | None = None
    incidents: list[Incident] = field(default_factory=list)  # opened by this report's violations
    device_flags: int = 0  # DeviceFlag bits the kernels raised (one step late on CUDA)


@dataclass
class CanaryTotals:
    """Host-side running totals (read from the device one step late)."""

    steps: int = 0
    forwards: int = 0
    sweeps: int = 0
    violations: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_launch_point: Counter = field(default_factory=Counter)
    by_label: Counter = field(default_factory=Counter)  # (reason, launch point, pool) -> count, for metrics
    recomputed_requests: int = 0
    watchdog_alarms: int = 0
    device_errors: int = 0  # steps whose kernels raised a device error flag
    seconds: float = 0.0


def _window_of(entries: np.ndarray) -> tuple | None:
    """(the array owning a sweep window's memory, its address, its length): equal for two windows
    that are the same entries of one ``RunCache`` array (which nothing writes; the kept window
    keeps its owner alive, so no other array takes that address). None for no array view."""
    base = entries.base if isinstance(entries, np.ndarray) else None
    if base is None:
        return None
    return base, entries.__array_interface__["data"][0], len(entries)


_SLOT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _outside(t: torch.Tensor, n: int) -> bool:
    """Whether an integer of ``t`` (one of ``_SLOT_DTYPES``) lies outside [0, n). On the host, for
    64- and 32-bit words, one reduction of the words as unsigned: a negative one wraps above any
    n they can address. On CUDA: one reduction (the least and the largest), one small copy."""
    if not t.numel():
        return False
    if t.is_cuda:
        lo, hi = torch.stack(torch.aminmax(t)).tolist()
        return lo < 0 or hi >= n
    v = t.numpy()
    if v.itemsize == 8:
        return int(v.view(np.uint64).max()) >= n
    if v.itemsize == 4 and n <= 1 << 31:
        return int(v.view(np.uint32).max()) >= n
    return int(v.min()) < 0 or int(v.max()) >= n


def _position_of(row: torch.Tensor) -> int:
    """The position a host row (uint8[ROW_BYTES], on the host) of ``export_rows`` holds."""
    return int(row[8 * POSITION: 8 * POSITION + 8].numpy().view(np.int64)[0])


def _slots_of_runs(runs: Sequence[SweepRun]) -> np.ndarray:
    """Every slot of ``runs``, concatenated, as an int64 host array."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return torch.cat([r.slots.reshape(-1).to("cpu", torch.int64) for r in runs]).numpy()


def fused_backend(fused: bool | None, device: torch.device) -> Backend | None:
    """Who runs HEAD and TAIL as one ``check_forward`` call each (``CanaryConfig.fused``): the Triton
    kernel on CUDA (or, ``fused=True``, interpreted on the CPU), the compiled CPU kernel on the CPU
    where numba serves; None (``fused=False``, or no kernel): the ops one by one."""
    if fused is False:
        return None
    if device.type == "cuda" or fused:
        return Backend.TRITON if HAS_TRITON else None
    return Backend.NUMBA if cpu_kernels_usable() else None


class Canary:
    def __init__(self, config: CanaryConfig, geometry: PoolGeometry, *, sources: Sequence[KVSource] = (),
                 pool: PoolKind = PoolKind.FULL, window: int = 0, warmup: bool = True):
        self.config, self.geometry, self.pool = config, geometry, pool
        self._tags = {p: LaunchTag(p, pool).value for p in LaunchPoint}  # looked up at every launch
        self.window = window  # > 0: a sliding-window pool, addressed through ForwardBatch.slot_lut
        dev = torch.device(geometry.device)
        # records, ring, counter, stats, error flags, check_forward workspaces: one validated object
        self.state = DeviceState.allocate(geometry.num_slots, ring_capacity=config.ring_capacity,
                                          max_bs=config.max_bs, max_tokens=config.max_tokens, device=dev)
        self.marks = WriteMarks.allocate(geometry.num_slots, dev)  # HEAD's write-conflict check (Triton)
        # idle prefix-cache slots the next HEAD must not see written; with the Triton check a view of the
        # slots in ``_held_counted``, which that HEAD reads (set: a hold no HEAD has consumed yet)
        self.held: torch.Tensor | None = None
        self.plan = Plan.allocate(config.plan_capacity, config.max_bs, dev)
        self.sweep_plan = Plan.allocate(config.plan_capacity, 1, dev)
        self.sweep_plan.enable.fill_(1)  # a sweep plan never overflows: its loads cap the count
        self.truth = torch.full((geometry.rows, geometry.max_ctx), -1, dtype=torch.int32, device=dev)
        self.truth_lens = torch.zeros(config.max_bs, dtype=torch.int64, device=dev)
        self._device_index_of_truth = self.truth.get_device()  # a batch's device is compared as this int
        # HEAD and TAIL are one check_forward call each where a kernel serves; else the ops one by one
        self.backend = fused_backend(config.fused, dev)
        self.fused = self.backend is not None
        self.sources = list(sources) if config.real_kv is not FingerprintMode.NONE else []
        self.meta = source_meta(self.sources, config.real_kv, dev) if self.sources else None
        # on the CPU: the truth scatter, HEAD and TAIL as one compiled call each, the Python around them cut
        self.cpu = CpuForward(config, self.state, self.sources, self.meta, self.truth, self.truth_lens, window,
                              self.sweep_plan.capacity) if self.backend is Backend.NUMBA else None
        self.reporter = Reporter(self.state.ring, self.state.ring_counter, self.state.stats,
                                 tuple((src.layer, src.half) for src in self.sources), error=self.state.error,
                                 block=self.state.counter_block())
        self.watchdog = Watchdog(config.watchdog_steps, periodic_sweeps=config.sweep_interval > 0)
        self.totals = CanaryTotals()
        self.incidents = IncidentTracker()
        self.request_names: Mapping[int, str] = {}  # engine request id -> the client's id, for the lines
        self.host_rows: torch.Tensor | None = None
        self._host_views: tuple | None = None  # CPU: numpy views of records, side words and host rows
        self._sweep_cursor = 0
        self._runs = RunCache()  # the sweeps' runs as host arrays, kept while they are unchanged
        # the window of those arrays the sweep plan holds (``_window_of``): a sweep over the same
        # entries launches the verify without staging or copying them again
        self._plan_window: tuple | None = None
        self._plan_blocks: list | None = None  # or those arrays' kept blocks, in order (``_sweep_whole``)
        # CUDA: pinned words a sweep's entries are copied from (packed by ``_staged``, or laid out by
        # the sweep's graphs), the device words they land in before they are spread into the plan's
        # columns, and the event of their last copy; made here, not at the first sweep, which would
        # pay the pinned allocation (about a ms)
        on_cuda = dev.type == "cuda"
        words = staging_words(self.sweep_plan.capacity)
        self._staging = torch.zeros(words, dtype=torch.int32, pin_memory=True) if on_cuda else None
        self._landing = torch.zeros(words, dtype=torch.int32, device=dev) if on_cuda else None
        self._staging_read = torch.Event(device=dev) if on_cuda else None  # recorded on the current stream in C++
        self._sweep_graphs: SweepGraphs | None = None  # the plan's load and verify as graphs (``warmup``)
        # the Triton check: the held slots counted (``ops.conflicts``: the count, then the slots; every
        # slot at most once, as a prefix cache holds each slot in one place), the words every HEAD reads,
        # eager or replayed from a graph, and zeroes once read; on CUDA written from pinned words in one
        # copy (with the event of the last one)
        counted = self.backend is Backend.TRITON
        self._held_counted = torch.zeros(1 + geometry.num_slots, dtype=torch.int64, device=dev) if counted else None
        self._held_host = (torch.zeros(1 + geometry.num_slots, dtype=torch.int64, pin_memory=True),
                           torch.cuda.Event()) if counted and on_cuda else None
        self._meta = StepMeta(0)
        self._last_point_of_step: dict[int, int] = {}
        self._replays = 0  # forwards prepared since the last end_step whose TAIL did not run eagerly
        # the last publication, an eager TAIL's, carries the counters: nothing launched since (``join``)
        self._tail_current = False
        # where HEAD is the Triton launch (CUDA, or the interpreter): the truth scatter is launched with
        # HEAD, not by ``prepare_head`` (a captured forward appends inside its graph; an eager one's
        # scatter goes into its HEAD's launch), and the batch whose scatter does so (``prepare_head``)
        self._truth_with_head = dev.type == "cuda" or self.backend is Backend.TRITON
        self._scatter_for: ForwardBatch | None = None
        # a graph that captures TAIL also publishes the counters (runtime.snapshots): no copy per replay
        self.publishing = self.fused and dev.type == "cuda" and self.reporter.start_publishing()
        # HEAD's checks and TAIL off the model's critical path (CanaryConfig.overlap): a side stream,
        # for captured forwards only (CAPTURED) or for eager ones too (``side_eager``: ALWAYS)
        on_side = config.overlap is not Overlap.OFF and self.fused and dev.type == "cuda"
        # high priority: where the model's programs fill every SM (large decode batches), the side
        # stream's blocks are scheduled as SMs free up rather than after the model's queued ones, so
        # the join after TAIL waits less (a captured graph keeps each kernel's stream priority)
        self.side = torch.cuda.Stream(device=dev, priority=-1) if on_side else None
        self.side_eager = config.overlap is Overlap.ALWAYS
        self._on_cuda = dev.type == "cuda"
        if self.side is not None:
            self._device_index = self.side.device_index
            self._forked, self._joined = torch.cuda.Event(), torch.cuda.Event()
        self._side_busy = False  # side work the current stream has not waited for yet
        self._side_captured = False  # ... launched inside a graph capture (joined inside it)
        self._tail_started = False
        # Triton: HEAD's and TAIL's launches with the canary's own arguments checked once (ops.check.BoundCheck)
        self._bound = self._bind_checks() if self.backend is Backend.TRITON else None
        # CUDA: the sweeps' verify with its plan checked once, and the plan's six entry columns as one block
        self._sweep_verify = BoundVerify(self.state, self.sweep_plan, self.sources, config.real_kv, self.meta) \
            if self._bound is not None and dev.type == "cuda" else None
        self._sweep_block = self.sweep_plan.entry_columns() if dev.type == "cuda" else None
        self._bound_marks = None  # ... and the side stream's HEAD: its write marks, on the model's stream
        if self._bound is not None and self.side is not None and self.sources:
            self._bound_marks = BoundMarks(self.state, self.sources, self.meta, config.real_kv)
        # an eager forward's HEAD and TAIL on the current stream as graph replays (``eager_graphs``; on the
        # CPU, the Triton kernel interpreted, as launches over the same buckets)
        self._eager: EagerGraphs | None = None
        if config.eager_graphs and self._bound is not None and "head" in self._bound and not self.window:
            self._eager = EagerGraphs(self._bound["head"], self._bound["tail"],
                                      tags=(self._tags[LaunchPoint.HEAD], self._tags[LaunchPoint.TAIL]),
                                      held_words=self._held_counted, publish=self.publishing,
                                      max_bs=config.max_bs, max_tokens=config.max_tokens, check=self.state.check)
        self.warmup_seconds = 0.0
        if warmup and dev.type == "cuda":
            self.warmup()
        elif warmup and self.backend is Backend.NUMBA:  # compiled once per machine, then loaded from disk
            self.warmup_seconds = compile_cpu_kernels()

    def _bind_checks(self) -> dict[str, BoundCheck] | None:
        """The ``BoundCheck`` of each launch: "head" (HEAD on the current stream, marking the write
        targets in the sources), "tail", and with a side stream "side_head" (HEAD on the side
        stream marks no source: ``mark_writes`` does, on the model's stream); None where one refuses
        the canary's own arguments (every call then takes ``check_forward``, which raises the error)."""
        memo = BatchMemo()  # a forward's TAIL finds its batch laid out as its HEAD found it

        def bind(stamp: bool, sources, publication=None) -> BoundCheck:
            return BoundCheck(self.state, stamp=stamp, sources=sources, mode=self.config.real_kv, meta=self.meta,
                              window=self.window, marks=self.marks if stamp else None, truth=self.truth,
                              truth_lens=self.truth_lens, memo=memo, publication=publication)

        pub = self.reporter.publication if self.publishing else None
        try:  # an eager TAIL publishes the counters from its own launch (``end_step`` then launches none)
            bound = {"tail": bind(False, self.sources, (pub.seq, pub.rows) if pub is not None else None)}
            if self.side is not None:
                bound["side_head"] = bind(True, ())
            if self.side is None or not self.side_eager:
                bound["head"] = bind(True, self.sources)
            return bound
        except KVCanaryError:
            return None

    def _checked(self, b: ForwardBatch, tag: int, launch: str, truth: bool, held=None, publish: bool = False,
                 scatter: bool = False) -> bool:
        """HEAD or TAIL of ``b`` through the bound ``launch`` (``_bind_checks``; ``held``: the
        counted held slots, ``_held_now``; ``publish``: TAIL publishing the counters; ``scatter``:
        HEAD scattering ``b``'s token truth first, whole histories or appends); False (nothing
        launched): call ``check_forward``."""
        bound = self._bound
        if bound is None:
            return False
        ids, offsets, starts = (b.truth_ids, b.truth_offsets, b.truth_starts) if scatter else (None, None, None)
        return bound[launch](b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids,
                             b.positions, b.out_cache_loc, tag=tag, truth=truth,
                             lut=b.slot_lut if self.window else None, held_words=held,
                             publish=publish, truth_ids=ids, truth_offsets=offsets, truth_starts=starts)

    def _on_side(self, capturing: bool | None = None) -> bool:
        """Whether this forward's HEAD and TAIL go to the side stream (``CanaryConfig.overlap``);
        ``capturing``: whether the current stream is capturing, when the caller asked already."""
        if self.side is None:
            return False
        return self.side_eager or (torch.cuda.is_current_stream_capturing() if capturing is None else capturing)

    def warmup(self) -> float:
        """Compile every kernel variant this canary launches, so no step pays a compile, and on
        CUDA capture the sweep plan's load and verify (``runtime.sweep_graphs``); runs on
        construction on CUDA (``warmup=False`` skips it: sweeps then launch one by one). Touches no
        record; returns seconds."""
        self.warmup_seconds = warm_up(self)
        return self.warmup_seconds

    def _capture_sweeps(self) -> None:
        """The sweep plan's load and verify as graphs (CUDA with the bound verify), once; where
        the device cannot capture them, sweeps launch one by one, as without a warm-up."""
        if (self._sweep_graphs is not None or self._sweep_verify is None or self._sweep_block is None
                or torch.cuda.is_current_stream_capturing()):
            return
        tag = self.tag(LaunchPoint.SWEEP)
        verify = self._sweep_verify
        try:
            self._sweep_graphs = SweepGraphs(self.sweep_plan, self._sweep_block, lambda: verify(tag), self._staging,
                                             self._landing, self._staging_read, self.state.check)
        except RuntimeError as e:
            log.warning("kv_canary: sweeps launch one by one, their graphs could not be captured (%s)", e)

    def tag(self, point: LaunchPoint) -> int:
        return self._tags[point]

    def join(self) -> None:
        """Order the current stream after the canary's side-stream work (``CanaryConfig.overlap``).
        ``tail`` joins; so does every call that touches the canary's state on the current stream
        (so after a join an eager TAIL's publication no longer carries the counters)."""
        self._tail_current = False
        if not self._side_busy:
            return
        # a capture starts synchronised: eager side work needs no wait inside it (nor could have one)
        if torch.cuda.is_current_stream_capturing() == self._side_captured:
            self._joined.record(self.side)
            torch.cuda.current_stream(self._device_index).wait_event(self._joined)
        self._side_busy = False

    def _fork(self) -> torch.cuda.Stream:
        """The side stream, ordered after everything launched so far on the current stream."""
        # one event each way, recorded again at every fork and join (a wait takes the record it
        # was queued behind), instead of the new event a stream's wait_stream makes every call
        self._forked.record(torch.cuda.current_stream(self._device_index))
        self.side.wait_event(self._forked)
        self._side_busy, self._side_captured = True, torch.cuda.is_current_stream_capturing()
        return self.side

    # --- per forward -------------------------------------------------------------------------

    @contextmanager
    def forward(self, batch: ForwardBatch):
        """HEAD before the body, TAIL after it (not after an exception: the forward did not finish)."""
        self.head(batch)
        yield
        self.tail(batch)

    def head(self, b: ForwardBatch) -> None:
        """Verify every prefix slot the batch reads, then stamp the slots it writes and mark their
        covered K/V bytes (TAIL requires the marks gone: MISSED_WRITE)."""
        if not self.config.enabled:
            return
        self.prepare_head(b, eager=True)
        self.launch_head(b)

    def prepare_head(self, b: ForwardBatch, eager: bool = False) -> None:
        """The host-fed half of HEAD: remember the batch for the report, scatter its token truth.
        Not capturable (its input sizes change every step); run it before a graph replay. On CUDA
        a batch of truth appends (``ForwardBatch.truth_starts``) is appended by ``launch_head``
        instead, inside the graph: its sizes are fixed. ``eager``: the caller launches this
        batch's HEAD next, on the host (``launch_head``, not a graph replay); on CUDA its truth
        scatter (whole histories or appends) then goes into HEAD's own launch, one launch fewer.
        ``end_step`` raises KVCanaryError where no ``launch_head`` of the batch came (a replay
        read the table without its histories)."""
        if type(eager) is not bool:
            raise KVCanaryError(f"prepare_head eager must be True or False, got {eager!r}")
        if not self.config.enabled:
            return
        if b.batch_size > self.config.max_bs:
            raise ValueError(f"batch size {b.batch_size} > CanaryConfig.max_bs ({self.config.max_bs}); raise max_bs")
        t0 = time.perf_counter()
        self._tail_current = False  # the truth scatter writes the error flags
        if self._side_busy:
            self.join()  # a HEAD or TAIL left unjoined (a forward that raised) reads the truth table
        if self._scatter_for is not None:  # a forward that raised before its HEAD: its scatter, as it would have run
            self._scatter_pending()
        use_truth = self.config.truth and b.truth_offsets is not None  # ``_use_truth``, without its call
        on_device = use_truth and self._truth_with_head
        if on_device:
            self._check_truth_batch(b)
        self._meta.batch = b
        if self.incidents.open:  # a rewrite closes an open incident; nothing to track otherwise
            self.incidents.note(self._meta.step, self._written(b), "rewritten")
        self.totals.forwards += 1  # here, not in tail: a graph replay runs launch_head and tail on the device only
        self._replays += 1  # until its TAIL runs eagerly
        if on_device:  # one launch that also writes truth_lens; checked when built
            if eager and self._bound is not None and "head" in self._bound:
                self._scatter_for = b  # HEAD's launch scatters (or ``launch_head`` first, where it cannot)
            elif b.truth_starts is None:  # appends: ``launch_head``'s, captured with the forward
                self._scatter_device(b)
        elif use_truth and not (self.cpu is not None and self.cpu.defer_scatter(b)):  # CPU: in HEAD's call
            self._scatter_truth(b)
        self.totals.seconds += time.perf_counter() - t0

    def _scatter_device(self, b: ForwardBatch) -> None:
        """``b``'s truth scatter launched alone (HEAD the Triton launch; whole histories, or appends
        where ``b`` has starts), one launch that also writes truth_lens; its tensors checked when
        ``b`` was built and by ``_check_truth_batch``."""
        scatter_validated(b.truth_ids, b.truth_offsets, b.req_pool_indices, self.truth, self.state.error,
                          self.truth_lens, HAS_TRITON, b.truth_starts)

    def _scatter_pending(self) -> None:
        """The scatter ``prepare_head`` left to a HEAD that is not taking it, launched now."""
        b, self._scatter_for = self._scatter_for, None
        self.join()
        self._scatter_device(b)

    def _scatter_truth(self, b: ForwardBatch) -> None:
        scatter_req_token_ids(flat_in=b.truth_ids, offsets=b.truth_offsets, req_pool_indices=b.req_pool_indices,
                              pool_out=self.truth, error_flag=self.state.error, lens_out=self.truth_lens,
                              starts=b.truth_starts)

    def _cpu_check(self, b: ForwardBatch, tag: int, stamp: bool) -> bool:
        """HEAD or TAIL through the CPU path (``runtime.cpu_forward``); False: run the ops (the
        truth scatter HEAD's call would have made, made first)."""
        if self.cpu.check(b, tag, stamp, self._use_truth(b), self.held if stamp else None):
            return True
        pending = self.cpu.take_scatter()
        if pending is not None and self._use_truth(pending):
            self._scatter_truth(pending)
        return False

    def _check_truth_batch(self, b: ForwardBatch) -> None:
        """What the truth scatter on CUDA needs beyond what ``ForwardBatch`` checked when it was
        built (dtypes, ranks, lengths, one device; device tensors get no value checks: the kernel
        masks and flags bad offsets and rows): the canary's device and contiguous tensors."""
        if b.req_to_token.get_device() != self._device_index_of_truth:
            raise BatchError(f"ForwardBatch is on {b.req_to_token.device} but the canary is on {self.truth.device}")
        for t in (b.truth_ids, b.truth_offsets, b.req_pool_indices, b.truth_starts):  # read as attributes: once a step
            if t is not None and not t.is_contiguous():
                name = next(n for n in ("truth_ids", "truth_offsets", "req_pool_indices", "truth_starts")
                            if getattr(b, n) is t)
                raise BatchError(f"ForwardBatch.{name} must be contiguous (got strides {t.stride()}); "
                                 f"pass {name}.contiguous()")

    def launch_head(self, b: ForwardBatch) -> None:
        """The device half of HEAD: fixed-size launches only, no host sync, no allocation on the
        fused (CUDA) path, so it can be captured in a CUDA graph with the forward."""
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        # the small helpers (``tag``, ``_on_side``, ``_use_truth``, ``_lut``) written out on this path and
        # TAIL's: an eager forward calls both between its model's launches, where each Python call costs µs
        bs, tag = b.batch_size, self._tags[LaunchPoint.HEAD]
        capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()  # asked once a HEAD
        on_side = self.side is not None and (self.side_eager or capturing)
        # the scatter ``prepare_head`` left to this HEAD: in its launch where it runs eagerly on the model's
        # stream; else (another batch's, a side-stream or captured HEAD) launched first, as it would have been
        given = self._scatter_for is b
        fold = given and self.fused and not on_side and not capturing
        if self._scatter_for is not None and not fold:
            self._scatter_pending()
        if self.cpu is not None and self._cpu_check(b, tag, True):
            self.held = None
            self.totals.seconds += time.perf_counter() - t0
            return
        truth = self.truth if self.config.truth and b.truth_offsets is not None else None
        if truth is not None and b.truth_starts is not None and not given and self._truth_with_head:
            # appends ``prepare_head`` left to the graph (a captured forward, or one it was not told is eager),
            # on the current stream ahead of HEAD's checks: fixed sizes, so a replay appends on the device
            self.join()  # the last TAIL read the table
            self._scatter_device(b)
        if on_side:
            self._launch_head_overlapped(b, tag, truth, capturing)
            self.totals.seconds += time.perf_counter() - t0
            return
        if self.fused:
            self.join()  # an eager HEAD after a side one (ALWAYS, or an unjoined capture): stream-ordered again
            self._tail_started = False
            held = self._held_now(capturing)
            counted = self._held_counted is not None
            self._scatter_for = None
            if self._eager is not None and not capturing and self._eager.head(b, truth is not None, fold):
                self.held = None  # the replay read the counted words
                self.totals.seconds += time.perf_counter() - t0
                return
            if not self._checked(b, tag, "head", truth is not None, held, scatter=fold):
                if fold:
                    self._scatter_device(b)
                check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                              extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                              positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=True, truth=truth,
                              truth_lens=self.truth_lens[:bs] if truth is not None else None, sources=self.sources,
                              mode=self.config.real_kv, meta=self.meta, lut=self._lut(b), window=self.window,
                              marks=self.marks, held=None if counted else held, held_words=held if counted else None,
                              backend=self.backend)
            if not capturing:  # a capture consumes nothing now: the count stays for its replay or ``end_step``
                self.held = None
            self.totals.seconds += time.perf_counter() - t0
            return
        truth_lens = self.truth_lens[:bs] if truth is not None else None
        build_plan(req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens, extend_lens=b.extend_lens,
                   req_to_token=b.req_to_token, plan=self.plan, truth=truth, truth_lens=truth_lens,
                   lut=self._lut(b), window=self.window)
        verify(state=self.state, plan=self.plan, tag=tag)
        woff = self.plan.write_offsets[: bs + 1]
        check_writes(state=self.state, plan=self.plan, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids,
                     positions=b.positions, req_pool_indices=b.req_pool_indices, write_offsets=woff, tag=tag,
                     lut=self._lut(b), held=self.held, marks=self.marks)
        self.held = None
        expected = None
        if truth is not None:
            expected = gather_expected_tokens(truth=truth, truth_lens=truth_lens, req_pool_indices=b.req_pool_indices,
                                              prefix_lens=b.prefix_lens, extend_offsets=woff, input_ids=b.input_ids)
        stamp(state=self.state, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids, positions=b.positions,
              req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens, write_offsets=woff,
              seed=self.plan.seed[:bs], tag=tag, expected_tokens=expected, lut=self._lut(b))
        mark_writes(state=self.state, out_cache_loc=b.out_cache_loc, sources=self.sources, lut=self._lut(b))
        self.totals.seconds += time.perf_counter() - t0

    def _launch_head_overlapped(self, b: ForwardBatch, tag: int, truth, capturing: bool) -> None:
        """HEAD with ``overlap``: the write marks on the current stream, ahead of the forward's
        writes; the rest of HEAD (it reads no K/V, the forward reads no record) on the side stream.
        ``capturing``: whether the current stream is capturing."""
        self.join()  # the last TAIL is done: a reused write target never shows it this step's mark
        self._tail_started = False  # a forward that raised never reached its tail
        lut, held = self._lut(b), self._held_now(capturing)  # the counted words (a side stream: Triton)
        with torch.cuda.stream(self._fork()):  # checks every input before it launches anything
            if not self._checked(b, tag, "side_head", truth is not None, held):
                check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                              extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                              positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=True, truth=truth,
                              truth_lens=self.truth_lens[:b.batch_size] if truth is not None else None, lut=lut,
                              window=self.window, marks=self.marks, held_words=held, backend=self.backend)
        if not capturing:
            self.held = None
        if self.sources and not (self._bound_marks is not None and self._bound_marks(b.out_cache_loc, lut)):
            # inputs checked above; on the current stream, ahead of the forward's writes
            mark_writes(state=self.state, out_cache_loc=b.out_cache_loc, sources=self.sources, lut=lut, meta=self.meta,
                        mode=self.config.real_kv)

    def start_tail(self, b: ForwardBatch) -> None:
        """Start TAIL before the forward ends (``CanaryConfig.overlap``): call it once the forward
        has written and read the K/V of every covered layer (after the last covered layer's
        attention); TAIL then runs on the side stream beside the rest of the forward, and ``tail``
        only joins it. Capturable. Does nothing where the forward has no side stream (``overlap``
        OFF, or an eager forward under CAPTURED): ``tail`` runs TAIL on the current stream."""
        if not self.config.enabled or self._tail_started or not self._on_side():
            return
        t0 = time.perf_counter()
        self._fork_tail(b, torch.cuda.is_current_stream_capturing())
        self.totals.seconds += time.perf_counter() - t0

    def _fork_tail(self, b: ForwardBatch, capturing: bool) -> None:
        with torch.cuda.stream(self._fork()):
            self._launch_tail(b, capturing)
        self._tail_started = True

    def _launch_tail(self, b: ForwardBatch, capturing: bool, publish: bool = False) -> None:
        """TAIL's launch on the current stream; ``capturing``: whether that stream is capturing;
        ``publish``: an eager TAIL on the model's stream publishes the counters from its launch."""
        bs = b.batch_size
        tag, truth = self._tags[LaunchPoint.TAIL], self.config.truth and b.truth_offsets is not None
        if not self._checked(b, tag, "tail", truth, publish=publish):
            publish = False
            check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                          extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                          positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=False,
                          truth=self.truth if truth else None, truth_lens=self.truth_lens[:bs] if truth else None,
                          sources=self.sources, mode=self.config.real_kv, meta=self.meta, lut=self._lut(b),
                          window=self.window, backend=self.backend)
        if self.publishing and capturing:
            self.reporter.publish()  # each replay hands end_step its counters
            return
        self._tailed(publish)

    def _tailed(self, publish: bool) -> None:
        """After an eager TAIL on the current stream: its forward is no replay's; ``publish``: its
        launch published the counter block."""
        if self._replays:
            self._replays -= 1
        self._tail_current = publish
        if publish:
            self.reporter.published()

    def tail(self, b: ForwardBatch) -> None:
        """Verify the prefix again (stray writes during the forward, fingerprints), check every
        write target was written (its HEAD mark gone), then record the fingerprints of the slots
        just written. Capturable on the fused (CUDA) path. Where the forward has the side stream
        (``overlap``: inside a capture, or ALWAYS) it starts TAIL there unless ``start_tail`` did,
        then joins it: after ``tail`` the current stream is ordered after every check of the forward."""
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        tag = self._tags[LaunchPoint.TAIL]
        if self.cpu is not None and self._cpu_check(b, tag, False):
            self._replays = max(self._replays - 1, 0)
            self.totals.seconds += time.perf_counter() - t0
            return
        capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()  # asked once a TAIL
        if self._tail_started or (self.side is not None and (self.side_eager or capturing)):  # ``_on_side``
            if not self._tail_started:
                self._fork_tail(b, capturing)
            self._tail_started = False
            self.join()
        elif self.fused:
            if self._eager is not None and not capturing and self._eager.tail(b):
                self._tailed(self.publishing)
            else:
                self._launch_tail(b, capturing, self.publishing and not capturing)
        else:
            verify(state=self.state, plan=self.plan, tag=tag, sources=self.sources, mode=self.config.real_kv,
                   meta=self.meta)
            if self.sources:  # a write target still marked gets no fingerprint (ops.landed)
                landed = check_writes_landed(state=self.state, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids,
                                             positions=b.positions, sources=self.sources, tag=tag, lut=self._lut(b))
                written = self._written(b)
                fingerprint(slots=torch.where(landed, written, torch.zeros_like(written)), sources=self.sources,
                            mode=self.config.real_kv, state=self.state, record=True, meta=self.meta)
        self.totals.seconds += time.perf_counter() - t0

    def _held_now(self, capturing: bool) -> torch.Tensor | None:
        """The held slots for this HEAD: with the Triton check the counted words (``_held_counted``)
        where a hold waits, and always in a capture, so that each replay checks the slots held in
        its own step (none where the count is 0); elsewhere ``held``. ``capturing``: whether the
        current stream is capturing."""
        words = self._held_counted
        if words is None:
            return self.held
        return words if capturing or self.held is not None else None

    def _use_truth(self, b: ForwardBatch) -> bool:
        return self.config.truth and b.truth_offsets is not None

    def _lut(self, b: ForwardBatch) -> torch.Tensor | None:
        return b.slot_lut if self.window else None

    def _written(self, b: ForwardBatch) -> torch.Tensor:
        """The slots of this pool the forward writes: ``out_cache_loc``, through the window table."""
        lut = self._lut(b)
        return b.out_cache_loc if lut is None else lut[b.out_cache_loc]

    # --- sweeps and moved rows -----------------------------------------------------------------

    def hold(self, slots: torch.Tensor) -> None:
        """Slots (int64, this pool's numbering) the prefix cache holds that no request reads: the
        next HEAD reports a write into one of them as READ_CONFLICT naming the cache (row 0), a
        HEAD replayed from a CUDA graph included (the Triton check reads them counted on the
        device: ``_held_counted``); at most one step's: ``end_step`` drops those no HEAD read. On
        CUDA, host slots never wait for queued device work: they go through pinned memory."""
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        self._hold(slots)
        self.totals.seconds += time.perf_counter() - t0

    def _hold(self, slots: torch.Tensor) -> None:
        dev = self.state.device
        words = self._held_counted
        if words is not None:
            slots = slots.reshape(-1)
            if slots.device.type == "cpu":
                self._hold_host(slots.to(torch.int64).numpy())
                return
            if slots.shape[0] >= words.shape[0]:  # more than the words hold: each slot of the pool once (a sync)
                slots = slots.to(dev, torch.int64)
                slots = torch.unique(slots[(slots > 0) & (slots < self.geometry.num_slots)])
            n = slots.shape[0]
            words[1: 1 + n].copy_(slots)  # on the current stream, from this or another device
            words[:1].fill_(n)
            self.held = words[1: 1 + n]
            return
        if dev.type != "cuda" or slots.is_cuda or torch.cuda.current_stream(dev).query():
            self.held = slots.to(dev, torch.int64).contiguous()
        else:  # pinned by torch's caching host allocator, which keeps the block until the copy has read it
            self.held = slots.reshape(-1).to(torch.int64).pin_memory().to(dev, non_blocking=True)

    def _hold_host(self, slots: np.ndarray) -> None:
        """``hold`` of host slots (an int64 array nobody writes): with the Triton check into the
        counted words, on CUDA through the canary's own pinned words, one copy of the count and the
        slots (the last one has long been read)."""
        words = self._held_counted
        if words is None:
            self._hold(torch.from_numpy(slots))
            return
        if len(slots) >= words.shape[0]:  # more than the words hold (a cache holding a slot twice): each once
            slots = np.asarray(slots, dtype=np.int64)
            slots = np.unique(slots[(slots > 0) & (slots < self.geometry.num_slots)])
        n = len(slots)
        if self._held_host is None:  # the CPU (the interpreter): the words themselves
            host = words.numpy()
            host[1: 1 + n] = slots
            host[0] = n
        else:
            pinned, event = self._held_host
            event.synchronize()
            host = pinned.numpy()
            host[0] = n
            host[1: 1 + n] = slots
            words[: 1 + n].copy_(pinned[: 1 + n], non_blocking=True)
            event.record()
        self.held = words[1: 1 + n]

    def _hold_replayed(self, n: int, every: Callable[[], np.ndarray]) -> None:
        """``hold`` of the ``n`` slots the sweep's graphs just loaded: their count and slots, as the
        replay left them, copied into the counted words on the device (one copy); where they are
        more than the words hold (a cache holding a slot twice), ``every()``'s, each once."""
        words = self._held_counted
        if n >= words.shape[0]:
            self._hold_host(every())
            return
        words[: 1 + n].copy_(self._sweep_graphs.held[: 1 + n])
        self.held = words[1: 1 + n]

    def sweep_due(self, step: int) -> bool:
        return self.config.enabled and self.config.sweep_interval > 0 and step % self.config.sweep_interval == 0

    def entry_bytes(self) -> int:
        fp = sum(4 * s.words_read(self.config.real_kv) for s in self.sources)
        return 2 * RECORD_BYTES + 16 + fp

    def sweep(self, runs: Sequence[SweepRun], budget_bytes: int | None = None, *, hold: bool = False) -> int:
        """Verify up to the byte budget of ``runs`` (continuing where the last sweep stopped; runs
        that fit the budget are verified whole, from the first: ``_sweep_whole``), fingerprints
        included. Always launches, even with nothing to sweep. Returns the number
        of slots queued for checking. ``hold``: also hold every slot of ``runs`` for the next HEAD
        (``hold`` of their concatenation), taken from the entries the sweep built."""
        if type(hold) is not bool:
            raise KVCanaryError(f"sweep hold must be True or False, got {hold!r}")
        if not self.config.enabled:
            return 0
        t0 = time.perf_counter()
        budget = self.config.sweep_budget_bytes if budget_bytes is None else budget_bytes
        n_max = min(budget // self.entry_bytes(), self.sweep_plan.capacity)
        if self._sweep_graphs is not None or self.cpu is not None:
            n = self._sweep_whole(runs, n_max, hold)
            if n is not None:
                self.totals.sweeps += 1
                self.totals.seconds += time.perf_counter() - t0
                return n
        start = self._sweep_cursor
        (slot, pred, pos, tok), self._sweep_cursor = sweep_entries(runs, start, n_max, self._runs)
        window = _window_of(slot)
        held = self._plan_window
        if window is not None and held is not None and window[0] is held[0] and window[1:] == held[1:]:
            self._verify_sweep_plan()  # the entries the plan holds: nothing to stage or copy
            n = window[2]
        else:
            n = self._load_sweep_plan(slot, pred, pos, tok)
            if self.cpu is None:  # the plan holds them (the compiled CPU verify reads the host arrays)
                self._plan_window = window
        if hold:
            every = self._runs.last
            if every is not None and self._sweep_graphs is not None and n and n == every.shape[1] and start % n == 0:
                self._hold_replayed(n, lambda: every[0])  # every slot, in order: widened by the replay
            else:
                self._hold_host(every[0] if every is not None else _slots_of_runs(runs))
        self._meta.sweep_runs.append((slot, pos))
        self.totals.sweeps += 1
        self.totals.seconds += time.perf_counter() - t0
        return n

    def prefetch_sweep(self, runs: Sequence[SweepRun]) -> int:
        """Build the entries of ``runs`` now, so that the next ``sweep`` finds them built and
        converts only the runs that changed or came since (a sweep keeps each run's entries while
        the run is unchanged: ``RunCache``). For the step before a sweep, where the host waits for
        the device anyway: after a replayed forward's launch, before the sampling reads its
        result (pass runs with their slots on the host there: a device run's copy back would wait
        for the forward). Verifies, holds and launches nothing, touches no record; returns the
        entries of ``runs``."""
        if not self.config.enabled:
            return 0
        if isinstance(runs, torch.Tensor) or not isinstance(runs, Sequence):
            raise KVCanaryError(f"prefetch_sweep runs must be a sequence of SweepRun, got {type(runs).__name__}")
        for i, r in enumerate(runs):
            if type(r) is not SweepRun:
                raise KVCanaryError(f"prefetch_sweep runs[{i}] must be a SweepRun, got {type(r).__name__}")
        t0 = time.perf_counter()
        self._runs.entries(runs)
        self.totals.seconds += time.perf_counter() - t0
        return self._runs.total

    def _sweep_whole(self, runs: Sequence[SweepRun], n_max: int, hold: bool) -> int | None:
        """A sweep whose runs fit its budget whole: the same entries as ``sweep_entries`` takes,
        in run order from the first (every one is verified, so where the last sweep stopped does
        not matter), without cutting a window out of them. On CUDA, with the sweep's graphs,
        staged from each run's kept entries in one copy into the graphs' pinned rows, or verified
        again where the plan holds those very entries; on the CPU, the compiled verify reads the
        runs' joined arrays. None, with nothing done, where they do not fit."""
        cache = self._runs
        blocks = cache.entries(runs)
        n = cache.total
        if n > n_max:
            return None
        if self.cpu is not None:
            every = cache.concatenated(blocks)
            self._load_sweep_plan(every[0], every[1], every[2], every[3])
            if hold:
                self._hold_host(every[0])
            self._meta.sweep_runs.append(blocks)
            return n
        self._tail_current = False  # ``join``, called where it has work
        if self._side_busy:
            self.join()
        graphs, loaded = self._sweep_graphs, self._plan_blocks
        if loaded is not None and same_blocks(loaded, blocks):
            graphs.again()
        else:
            graphs.load_blocks(blocks, n)
            self._plan_window, self._plan_blocks = None, blocks
        if hold:
            self._hold_replayed(n, lambda: cache.concatenated(blocks)[0])  # every slot, in order: widened by the replay
        self._meta.sweep_runs.append(blocks)
        return n

    def _load_sweep_plan(self, slot, pred, pos, tok) -> int:
        """Load the sweep plan with entries (int64 host arrays or sequences) and verify it; more
        entries than the plan holds (a long landed copy) a plan's capacity at a time."""
        self.join()
        self._plan_window = self._plan_blocks = None  # until ``sweep`` names the entries it loaded
        p, n = self.sweep_plan, len(slot)
        if n > p.capacity:
            for at in range(0, n, p.capacity):
                cut = slice(at, at + p.capacity)
                self._load_sweep_plan(slot[cut], pred[cut], pos[cut], tok[cut])
            return n
        if self.cpu is not None and self.cpu.verify(slot, pred, pos, tok, self.tag(LaunchPoint.SWEEP)):
            return n  # the compiled verify of the entries themselves: no plan tensors filled
        graphs = self._sweep_graphs
        if graphs is not None:  # staged, then one replay: copy, spread, count, verify
            graphs.load((slot, pred, pos, tok), n)
            return n
        on_cuda = p.slot.device.type == "cuda"
        if n:
            block = self._sweep_block
            if block is not None:
                # five columns (entry = slot; row stays 0, no request: nothing else writes this plan's) in
                # one contiguous copy, then spread on the device: a copy of the [5, n] slice of the
                # columns straight from the host is strided, which torch stages through temporaries and
                # which waits for queued device work (H200: 380 µs behind a busy stream against 39)
                landing = self._landing[: 5 * n]
                landing.copy_(self._staged((slot, pred, pos, tok)), non_blocking=True)
                block[:5, :n].copy_(landing.view(5, n))
            else:
                cols = (self._staged((slot, pred, pos, tok)).view(5, n) if on_cuda else
                        torch.from_numpy(np.stack([np.asarray(v, dtype=np.int64) for v in (slot, pred, pos, tok,
                                                                                          slot)]).astype(np.int32)))
                for buf, vals in zip((p.slot, p.pred, p.position, p.token, p.entry), cols, strict=True):
                    buf[:n].copy_(vals, non_blocking=on_cuda)
                p.row[:n].zero_()  # idle slots: no request
        p.count.fill_(n)
        self._verify_sweep_plan()
        if n and on_cuda:
            self._staging_read.record()
        return n

    def _verify_sweep_plan(self) -> None:
        """Verify the entries the sweep plan holds."""
        self.join()
        p = self.sweep_plan
        if self._sweep_graphs is not None:  # the last load was a replay too: its words are still staged
            self._sweep_graphs.again()
        elif self._sweep_verify is not None:  # enable: set once (nothing else writes this plan's)
            self._sweep_verify(self.tag(LaunchPoint.SWEEP))
        else:
            p.enable.fill_(1)
            verify(state=self.state, plan=p, tag=self.tag(LaunchPoint.SWEEP), sources=self.sources,
                   mode=self.config.real_kv, meta=self.meta)

    def _staged(self, cols) -> torch.Tensor:
        """The sweep plan's first five entry columns packed in pinned host words, int32[5n] (``cols``:
        slot, pred, position, token, each n integers; then entry = slot), so the plan's copy is
        queued without blocking the host; the last sweep's copy has read the words before they are
        rewritten."""
        self._staging_read.synchronize()  # a sweep or more old: long done
        n = len(cols[0])
        words = self._staging[: 5 * n]
        host = words.numpy().reshape(5, n)
        for i in range(4):
            host[i] = cols[i]  # cast to int32 as they are written
        host[4] = host[0]
        return words

    def _check_slots(self, op: str, name: str, slots: torch.Tensor) -> None:
        """KVCanaryError naming the first of ``slots`` outside the pool, before anything is read or
        written (the gathers would stop the device on it, and a negative slot would index from the
        end; slots on CUDA: one reduction and one small copy to the host)."""
        if not isinstance(slots, torch.Tensor) or slots.dtype not in _SLOT_DTYPES:
            got = f"{slots.dtype} tensor" if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise KVCanaryError(f"{op} {name} must be a tensor of signed integer slots (int64, int32, int16 or "
                                f"int8), got {got}")
        n = self.state.num_slots
        if not _outside(slots, n):
            return
        flat = slots.reshape(-1)
        i = int(torch.nonzero((flat < 0) | (flat >= n))[0])
        raise KVCanaryError(f"{op} {name}[{i}] = {int(flat[i])} out of range [0, {n}) (this pool's slots)")

    def export_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``slots`` (uint8[n, ROW_BYTES]: each slot's 32-byte record, then its 8-byte
        source-tag side word) to travel with their K/V. Raises KVCanaryError for a slot outside
        the pool."""
        self._check_slots("export_rows", "slots", slots)
        return self._export(slots)

    def _export(self, slots: torch.Tensor) -> torch.Tensor:
        self.join()
        index = slots.to(self.state.device)
        tags = self.state.source_tags[index].view(torch.uint8).view(-1, ROW_BYTES - RECORD_BYTES)
        return torch.cat([self.state.records[index], tags], dim=1)

    def land_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows of ``export_rows`` into ``slots`` (records and side words), unverified.
        Raises KVCanaryError for rows that are not uint8[len(slots), ROW_BYTES] and for a slot
        outside the pool, before anything is written."""
        self._check_slots("land_rows", "slots", slots)
        self._land(slots, rows)

    def _land(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        n = slots.numel()
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or tuple(rows.shape) != (n, ROW_BYTES):
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise KVCanaryError(f"rows must be uint8[{n}, {ROW_BYTES}] (one export_rows row per slot), got {got}; "
                                "pass what export_rows gave")
        self.join()
        dev = self.state.device
        index, rows = slots.to(dev), rows.to(dev)
        self.state.records[index] = rows[:, :RECORD_BYTES]
        self.state.source_tags[index] = rows[:, RECORD_BYTES:].contiguous().view(torch.int64).view(-1)

    def import_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows that travelled with K/V (``export_rows``) into ``slots`` (the stamps are
        content-only, so they stay valid in any slot), then verify the landed slots at once (SWEEP)."""
        self._check_slots("import_rows", "slots", slots)
        self._import(slots, rows)

    def _import(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._land(slots, rows)
        # rows on the host: the first landed position read there (the same bytes), not from the device
        self._landed(slots, _position_of(rows[0]) if len(rows) and not rows.is_cuda else None)

    def _landed(self, slots: torch.Tensor, first_position: int | None) -> None:
        """Rows just written into ``slots``: their incidents close, and they are verified at once."""
        self.incidents.note(self._meta.step, slots, "rewritten")
        self.verify_landed(slots, first_position)

    def verify_landed(self, slots: torch.Tensor, first_position: int | None = None) -> int:
        """Check slots just filled by a copy: each against the one before it (consecutive positions)
        and its fingerprint; the first one's link is checked by the next HEAD that reads it.
        ``first_position``: the position the first landed record holds, where the caller has its
        bytes on the host (else it is read from the device)."""
        if first_position is not None and type(first_position) is not int:
            raise KVCanaryError(f"verify_landed first_position must be an int or None, got {first_position!r}")
        if not self.config.enabled or slots.numel() == 0:
            return 0
        s = slots.reshape(-1).to("cpu", torch.int64).numpy()
        first_pos = (int(self.state.records[int(s[0])].view(torch.int64)[1]) if first_position is None
                     else first_position)
        pos = np.arange(first_pos, first_pos + len(s), dtype=np.int64)
        self._meta.sweep_runs.append((s, pos))
        return self._load_sweep_plan(s, np.concatenate([[-1], s[:-1]]), pos, np.full(len(s), -1))

    def attach_host_tier(self, num_rows: int) -> None:
        """Keep a host mirror of records for a host offload tier of ``num_rows`` rows (call once,
        before the first ``offload``)."""
        if type(num_rows) is not int or num_rows < 1:
            raise ConfigError(f"attach_host_tier num_rows must be an int >= 1 (host tier rows), got {num_rows!r}")
        self.host_rows = torch.zeros(num_rows, ROW_BYTES, dtype=torch.uint8,
                                     pin_memory=self.state.records.is_cuda)
        if not self.state.records.is_cuda:  # the CPU: offloads copy rows through numpy views, no torch call
            self._host_views = (self.state.records.numpy(),
                                self.state.source_tags.numpy().view(np.uint8).reshape(-1, ROW_BYTES - RECORD_BYTES),
                                self.host_rows.numpy())

    def row_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The canary's rows for an engine that moves K/V between its pool and its host tier with a
        batched copy of its own: (device, host) pairs of uint8 views, [num_slots, w] and [num_rows,
        w], of the records (w = 32) and their side words (w = 8). With an offload's K/V, copy
        ``device[device_slots]`` into ``host[host_rows]`` (what ``offload`` does); with a load-back's,
        ``host[host_rows]`` into ``device[device_slots]``, then call ``rows_landed``. Copy between
        steps (``end_step`` joins the canary's side stream), on the stream the canary runs on.
        Raises KVCanaryError before ``attach_host_tier``."""
        if self.host_rows is None:
            raise KVCanaryError("row_pairs() before attach_host_tier(): there is no host mirror to copy into; call "
                                "canary.attach_host_tier(num_host_rows) once after building the Canary")
        records, tags = self.state.records, self.state.source_tags.view(torch.uint8).view(-1, ROW_BYTES - RECORD_BYTES)
        return (records, self.host_rows[:, :RECORD_BYTES]), (tags, self.host_rows[:, RECORD_BYTES:])

    def rows_landed(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """The engine copied the mirror's host rows ``host_rows[i]`` into ``device_slots[i]`` with
        their K/V (``row_pairs``): the landed slots are verified at once (SWEEP), as after
        ``load_back``. Raises KVCanaryError without a host tier or for mismatched rows, before
        anything is read."""
        self._check_host_move("rows_landed", device_slots, host_rows)
        if not self.config.enabled or not device_slots.numel():
            return
        t0 = time.perf_counter()
        self._landed(device_slots, _position_of(self.host_rows[int(host_rows[0])]))
        self.totals.seconds += time.perf_counter() - t0

    def offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Records follow K/V from ``device_slots[i]`` (int64[n]) to host row ``host_rows[i]`` (int64[n]).
        Raises KVCanaryError without a host tier (``attach_host_tier``) or for mismatched rows.
        Slots on the host cost less on CUDA: their range check reads them there (on the device it
        waits for a reduction and its copy back)."""
        self._check_host_move("offload", device_slots, host_rows)
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        if self._host_views is not None and not device_slots.is_cuda and not host_rows.is_cuda:
            records, tags, host = self._host_views
            slots, rows = device_slots.numpy(), host_rows.numpy()
            moved = records[slots], tags[slots]  # both read before any row is written (a bad slot raises here)
            host[rows, :RECORD_BYTES], host[rows, RECORD_BYTES:] = moved
        else:
            self.host_rows[host_rows.cpu()] = self._export(device_slots).cpu()
        self.totals.seconds += time.perf_counter() - t0

    def load_back(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Records follow K/V from host row ``host_rows[i]`` back to ``device_slots[i]``; verified at
        once. Raises KVCanaryError without a host tier (``attach_host_tier``) or for mismatched rows."""
        self._check_host_move("load_back", device_slots, host_rows)
        if self.config.enabled:
            t0 = time.perf_counter()
            self._import(device_slots, self.host_rows[host_rows.cpu()])
            self.totals.seconds += time.perf_counter() - t0

    def _check_host_move(self, op: str, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
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
        if _outside(host_rows, self.host_rows.shape[0]):
            lo, hi = int(host_rows.min()), int(host_rows.max())
            raise KVCanaryError(f"{op} host_rows must be in [0, {self.host_rows.shape[0]}) (attach_host_tier "
                                f"num_rows), got values in [{lo}, {hi}]")
        self._check_slots(op, "device_slots", device_slots)

    def slots_freed(self, slots: torch.Tensor) -> None:
        """The engine returned ``slots`` (int64[n]) to its allocator: their open incidents close,
        so damage found after the slots are reused is a new incident. Call it where the engine
        frees slots (never inside a captured region)."""
        if self.config.enabled:
            self.incidents.note(self._meta.step, slots, "freed")

    # --- after each step ---------------------------------------------------------------------

    def end_step(self, step: int) -> StepReport:
        """Snapshot this step's counters, decode what the device reported (one step late on CUDA),
        apply the policy, feed the watchdog, print the stats line when due. Raises CanaryViolation
        under the raise policy and WatchdogTimeout when checks stopped (raise and recompute)."""
        report = StepReport(step)
        if self.config.policy is Policy.OFF:
            return report
        t0 = time.perf_counter()
        if self._scatter_for is not None:
            self._missed_eager_head()
        if self._side_busy:
            self.join()  # the counters are copied on the current stream
        if self.held is not None and self._held_counted is not None:
            self._held_counted[:1].zero_()  # a hold no eager HEAD read (a replay's HEAD read it, or none ran)
        self.held = None  # held slots are one step's
        meta, reporter = self._meta, self.reporter
        meta.step = step
        if not self._on_cuda and reporter.read_in_place:  # the CPU: counters read where they are, without numpy
            report.violations = reporter.read_host(meta)
        else:
            report.violations = reporter.advance(meta, self._replays, self._tail_current)
        self._meta = StepMeta(step + 1)
        totals = self.totals
        totals.steps += 1
        report.alarms = self.watchdog.observe_tags(reporter.host_launches(), reporter.point_tags)
        self._replays, self._tail_current = 0, False
        if not self._on_cuda:
            report.device_flags = self._read_device_flags()
        elif reporter.flags_read:  # CUDA: read with the counters
            report.device_flags = self._take_device_flags(reporter.flags_read)
        # ``_log_due``, inlined: a clean step makes as few Python calls as it can (between a model's
        # launches each costs µs: its code is out of the caches)
        period, every = self.config.stats_period, self.config.incident_summary_steps
        if (report.violations or report.alarms or self.incidents.pending or (period and step % period == 0)
                or (every and step % every == 0)):
            self._account(report, upto_step=step - reporter.lag)
        totals.seconds += time.perf_counter() - t0
        if report.device_flags:
            self._report_device_flags(report)
        if report.violations or report.alarms:  # a clean step has no policy to apply
            self._apply_policy(report)
        return report

    def _missed_eager_head(self) -> None:
        """``prepare_head(batch, eager=True)`` and no ``launch_head`` of the batch before ``end_step``:
        scatter its histories now (the table stays right from here on), then raise."""
        b = self._scatter_for
        self._scatter_pending()
        raise KVCanaryError(f"prepare_head(batch, eager=True) for a batch of {b.batch_size} requests, then end_step "
                            "with no launch_head of that batch: its truth histories were scattered only now, so a "
                            "graph replay in between read the table without them; pass eager=True only where "
                            "launch_head(batch) follows on the host")

    def _read_device_flags(self, flush: bool = False) -> int:
        """The error flags the kernels raised (on CUDA: as of the snapshots the reporter just read,
        a step old, copied with the counters without a sync; everything when ``flush``), then
        cleared; a WORKSPACE flag also resets the workspaces."""
        err = self.state.error
        if err.is_cuda and not flush:
            bits = self.reporter.flags_read
        elif self.cpu is not None:  # the same word through numpy: no torch dispatch a step
            bits = self.cpu.error[0]
        else:
            bits = int(err[0])  # on CUDA this syncs: the end of a run
        return self._take_device_flags(bits) if bits else 0

    def _take_device_flags(self, bits: int) -> int:
        """Clear the error flags ``bits`` were read from (a WORKSPACE flag also resets the
        workspaces); returns ``bits``."""
        self.state.error.zero_()
        if bits & DeviceFlag.WORKSPACE:
            for ws in self.state.workspaces:
                ws.reset()
        return bits

    def _report_device_flags(self, report: StepReport) -> None:
        if not report.device_flags:
            return
        line = (f"kv_canary device error: step={report.step} flags={'+'.join(DeviceFlag.names(report.device_flags))} "
                "checks of this step are incomplete")
        self.totals.device_errors += 1
        log.error(line)
        if self.config.policy in (Policy.RAISE, Policy.RECOMPUTE):
            raise DeviceError(line)

    def flush(self, step: int) -> StepReport:
        """Read everything still pending (end of a run); blocks until the device is done."""
        if self._scatter_for is not None:
            self._scatter_pending()
        self.join()
        report = StepReport(step, self.reporter.collect(flush=True))
        report.device_flags = self._read_device_flags(flush=True)
        self._account(report, upto_step=step, summary=True)
        self._report_device_flags(report)
        self._apply_policy(report)
        return report

    def _account(self, report: StepReport, upto_step: int, summary: bool = False) -> None:
        """Totals, incidents and log lines of a report: a WARNING violation line for each
        violation that opens an incident, DEBUG for re-detections (counted into the periodic
        incident summary line, WARNING too)."""
        t = self.totals
        for v, opened in self.incidents.observe(report.violations, upto_step):
            t.violations += 1
            t.by_launch_point[v.point.name] += 1
            for name in Reason.names(v.reasons):
                t.by_reason[name] += 1
                t.by_label[name, v.point.name, v.tag.pool.name] += 1
            report.incidents += opened
            log.log(logging.WARNING if opened else logging.DEBUG, v.line(self.request_names))
        for a in report.alarms:
            t.watchdog_alarms += 1
            log.error(a.line())
        period = self.config.stats_period
        if period and report.step % period == 0:
            log.info(self.stats_line(report.step))
        every = self.config.incident_summary_steps
        if summary or (every and report.step % every == 0):
            line = self.incidents.summary_line(report.step)
            if line is not None:  # rate-limited: at most one per incident_summary_steps, only with news
                log.warning(line)

    def _apply_policy(self, report: StepReport) -> None:
        policy = self.config.policy
        if report.alarms and policy in (Policy.RAISE, Policy.RECOMPUTE):
            raise WatchdogTimeout("; ".join(a.line() for a in report.alarms))
        if not report.violations:
            return
        if policy is Policy.RAISE:
            first = report.violations[0]
            raise CanaryViolation(f"{len(report.violations)} KV-cache violation(s); first: {first.line()}",
                                  report.violations)
        if policy is Policy.RECOMPUTE:
            reqs = tuple(dict.fromkeys(r for v in report.violations for r in v.requests))
            slots = tuple(sorted({v.slot for v in report.violations
                                  if v.slot > 0 and not v.reasons & Reason.BAD_ENTRY}))
            report.recovery = Recovery(reqs, slots, min(v.step for v in report.violations))
            self.totals.recomputed_requests += len(reqs)

    # --- numbers -------------------------------------------------------------------------------

    def counters(self) -> dict:
        """Device counters as of the last snapshot read: launches, checked and stamped slots by point."""
        s = self.reporter.latest_stats
        out = {}
        for p in LaunchPoint:
            rows = s[4 * p: 4 * p + 4]
            out[p.name] = {"launches": int(rows[:, 0].sum()), "checked": int(rows[:, STAT_CHECKED].sum()),
                           "stamped": int(rows[:, STAT_STAMPED].sum())}
        out["ring_total"] = self.reporter.latest_total
        out["dropped"] = self.reporter.dropped
        out["plan_overflows"] = int(self.plan.overflow[0])
        return out

    def stats_line(self, step: int) -> str:
        c = self.counters()
        verified = sum(c[p.name]["checked"] for p in LaunchPoint)
        return (f"kv_canary stats: step={step} protected_tokens={c['HEAD']['stamped']} verified_slots={verified} "
                f"sweeps={self.totals.sweeps} violations={self.totals.violations} dropped={c['dropped']} "
                f"plan_overflows={c['plan_overflows']}")
