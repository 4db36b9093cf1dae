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
landed (``rows_landed``). Rows moved between canaries carry the sender's ``signature`` (a
``LayoutSignature``: ``runtime.signature``): ``import_rows`` / ``land_rows`` take it and refuse
rows of another layout, and a host mirror is adopted only by a canary of its layout. Violations
are grouped into incidents (``runtime.incidents``): the engine reports freed slots with
``slots_freed`` so that a slot's incidents close when it is reused.

The parts, each in its own file: the forward on one route chosen here once (``runtime.forward``:
``route_cpu``, ``route_triton``, ``route_ops``), holds (``holds``), sweeps (``sweeping``), the
rows that travel with K/V (``rows``), the policy (``policy``); the end of a step
(``end_step``: reporter, incidents, watchdog, policy) stays here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint, LaunchTag, PoolKind
from kvcanary.errors import ConfigError
from kvcanary.ops.backend import HAS_TRITON, Backend, compile_cpu_kernels, cpu_kernels_usable, use_triton
from kvcanary.ops.sources import KVSource, SourceSet
from kvcanary.ops.state import DeviceState
from kvcanary.runtime.arguments import check_int, check_point, check_runs, check_slots
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.context import CanaryContext, CanaryTotals
from kvcanary.runtime.forward import Forward
from kvcanary.runtime.holds import Holds
from kvcanary.runtime.policy import Recovery, WatchdogTimeout
from kvcanary.runtime.reporting import Reporter
from kvcanary.runtime.route_cpu import CpuRoute
from kvcanary.runtime.route_ops import OpsRoute
from kvcanary.runtime.route_triton import TritonRoute
from kvcanary.runtime.rows import HostMirror, Rows
from kvcanary.runtime.signature import LayoutSignature
from kvcanary.runtime.step_end import StepEnd, StepReport
from kvcanary.runtime.sweep import SweepRun
from kvcanary.runtime.sweeping import Sweeper
from kvcanary.runtime.warmup import restored, warm_scatter
from kvcanary.runtime.watchdog import Watchdog

__all__ = ["Canary", "CanaryTotals", "HostMirror", "LayoutSignature", "PoolGeometry",
           "Recovery", "StepReport", "WatchdogTimeout", "fused_backend"]

log = logging.getLogger("kvcanary")


@dataclass(frozen=True)
class PoolGeometry:
    """The pool a canary guards: ``num_slots`` slots, ``rows`` page-table rows of ``max_ctx``
    positions, on ``device``. The layout fields describe the K/V the slots hold; they go into the
    canary's ``signature``, which every move of rows between canaries compares (None: not given;
    ``page_size`` None: the sources' page size): ``page_size`` (slots per page), ``kv_dtype``
    (a torch.dtype or its name), ``num_kv_heads``, ``head_dim``, ``model`` (the model's identity,
    e.g. its name and revision)."""

    num_slots: int
    rows: int
    max_ctx: int
    device: str = "cpu"
    page_size: int | None = None
    kv_dtype: torch.dtype | str | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    model: str | None = None

    def __post_init__(self):
        for name in ("page_size", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ConfigError(f"PoolGeometry.{name} must be an int >= 1 or None, got {v!r}")
        if self.kv_dtype is not None and not isinstance(self.kv_dtype, (torch.dtype, str)):
            raise ConfigError(f"PoolGeometry.kv_dtype must be a torch.dtype, its name or None, got {self.kv_dtype!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"PoolGeometry.model must be a str or None, got {self.model!r}")


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
        self.window = window  # > 0: a sliding-window pool, addressed through ForwardBatch.slot_lut
        dev = torch.device(geometry.device)
        # records, ring, counter, stats, error flags, check_forward workspaces: one validated object
        self.state = DeviceState.allocate(geometry.num_slots, ring_capacity=config.ring_capacity,
                                          max_bs=config.max_bs, max_tokens=config.max_tokens, device=dev)
        # the K/V sources, their fingerprint mode and table, checked once (raises for bad sources)
        self.kv = SourceSet.build(sources, config.real_kv, geometry.num_slots, dev)
        self.sources, self.meta = self.kv.list(), self.kv.meta
        # what this canary's rows mean; every move of rows between canaries compares it (runtime.signature)
        self.signature = LayoutSignature.of(self.sources, config.real_kv, geometry)
        self.ctx = CanaryContext(config, self.state, {p: LaunchTag(p, pool).value for p in LaunchPoint}, window,
                                 self.kv)
        self.totals, self.incidents = self.ctx.totals, self.ctx.incidents
        self.truth = torch.full((geometry.rows, geometry.max_ctx), -1, dtype=torch.int32, device=dev)
        self.truth_lens = torch.zeros(config.max_bs, dtype=torch.int64, device=dev)
        # HEAD and TAIL are one check_forward call each where a kernel serves; else the ops one by one
        self.backend = fused_backend(config.fused, dev)
        self.fused = self.backend is not None
        self.reporter = Reporter(self.state.ring, self.state.ring_counter, self.state.stats,
                                 tuple((src.layer, src.half) for src in self.sources), error=self.state.error,
                                 block=self.state.counter_block())
        self.watchdog = Watchdog(config.watchdog_steps, periodic_sweeps=config.sweep_interval > 0)
        self.holds = Holds(self.state, counted=self.backend is Backend.TRITON)
        self.route = self._route()
        self.marks, self.plan = self.route.marks, self.route.plan
        self.cpu = self.route.compiled if isinstance(self.route, CpuRoute) else None
        self.sweeper = Sweeper(self.ctx, self.route, self.holds, self.cpu)
        self.sweep_plan = self.sweeper.plan
        self.rows = Rows(self.ctx, self.route, self.sweeper, self.signature)
        self.step_end = StepEnd(self.ctx, self.reporter, self.watchdog, self.route, self.holds, self.cpu)
        self.warmup_seconds = 0.0
        if warmup and dev.type == "cuda":
            self.warmup()
        elif warmup and self.backend is Backend.NUMBA:  # compiled once per machine, then loaded from disk
            self.warmup_seconds = compile_cpu_kernels()

    def _route(self) -> Forward:
        """The execution path of HEAD and TAIL, chosen once (``runtime.forward``)."""
        parts = (self.ctx, self.truth, self.truth_lens, self.holds)
        if self.backend is Backend.NUMBA:
            return CpuRoute(*parts, self.config.plan_capacity)
        if self.backend is Backend.TRITON:
            return TritonRoute(*parts, self.reporter)
        return OpsRoute(*parts)

    @property
    def held(self) -> torch.Tensor | None:
        """The held slots no HEAD has consumed yet (``hold``)."""
        return self.holds.held

    @held.setter
    def held(self, slots: torch.Tensor | None) -> None:
        self.holds.held = slots

    @property
    def request_names(self) -> Mapping[int, str]:
        """Engine request id -> the client's id, for the violation lines."""
        return self.step_end.names

    @request_names.setter
    def request_names(self, names: Mapping[int, str]) -> None:
        self.step_end.names = names

    @property
    def side(self) -> torch.cuda.Stream | None:
        """The side stream HEAD and TAIL take with ``CanaryConfig.overlap`` (None without)."""
        return self.route.side

    @property
    def side_eager(self) -> bool:
        return self.route.side_eager

    @property
    def publishing(self) -> bool:
        """Whether an eager TAIL publishes the counters from its own launch."""
        return self.route.publishing

    @property
    def host_rows(self) -> torch.Tensor | None:
        """The host mirror of records (``attach_host_tier``)."""
        return self.rows.host_rows

    @property
    def host_mirror(self) -> HostMirror | None:
        """The host mirror with the signature of the canary that made it (``attach_host_tier``)."""
        return self.rows.mirror

    def warmup(self) -> float:
        """Compile every kernel variant this canary launches, so no step pays a compile, and on
        CUDA capture the sweep plan's load and verify (``runtime.sweep_graphs``); runs on
        construction on CUDA (``warmup=False`` skips it: sweeps then launch one by one). Touches no
        record; returns seconds."""
        if not self.config.enabled:
            self.warmup_seconds = 0.0
            return 0.0
        t0 = time.perf_counter()
        state, plan = self.state, self.sweep_plan
        seconds = self.totals.seconds
        # a HEAD taking the scatter writes the first length
        with restored((state.stats, state.ring_counter, state.error, plan.count, plan.enable, self.truth_lens)):
            self.route.warm_up()
            if self.config.truth and use_triton(Backend.AUTO, state.device):
                warm_scatter(state.error)
            self.sweeper.warm_up()  # after the verify's compile: a capture cannot compile
        self.totals.seconds = seconds
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    def tag(self, point: LaunchPoint) -> int:
        return self.ctx.tags[check_point(point)]

    def join(self) -> None:
        """Order the current stream after the canary's side-stream work (``CanaryConfig.overlap``).
        ``tail`` joins; so does every call that touches the canary's state on the current stream
        (so after a join an eager TAIL's publication no longer carries the counters)."""
        self.route.join()

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
        self.route.prepare_head(b, eager=True)
        self.route.launch_head(b)

    def prepare_head(self, b: ForwardBatch, eager: bool = False) -> None:
        """The host-fed half of HEAD: remember the batch for the report, scatter its token truth.
        Not capturable (its input sizes change every step); run it before a graph replay. On CUDA
        a batch of truth appends (``ForwardBatch.truth_starts``) is appended by ``launch_head``
        instead, inside the graph: its sizes are fixed. ``eager``: the caller launches this
        batch's HEAD next, on the host (``launch_head``, not a graph replay); on CUDA its truth
        scatter (whole histories or appends) then goes into HEAD's own launch, one launch fewer.
        ``end_step`` raises KVCanaryError where no ``launch_head`` of the batch came (a replay
        read the table without its histories)."""
        self.route.prepare_head(b, eager)

    def launch_head(self, b: ForwardBatch) -> None:
        """The device half of HEAD: fixed-size launches only, no host sync, no allocation on the
        fused (CUDA) path, so it can be captured in a CUDA graph with the forward."""
        self.route.launch_head(b)

    def start_tail(self, b: ForwardBatch) -> None:
        """Start TAIL before the forward ends (``CanaryConfig.overlap``): call it once the forward
        has written and read the K/V of every covered layer (after the last covered layer's
        attention); TAIL then runs on the side stream beside the rest of the forward, and ``tail``
        only joins it. Capturable. Does nothing where the forward has no side stream (``overlap``
        OFF, or an eager forward under CAPTURED): ``tail`` runs TAIL on the current stream."""
        self.route.start_tail(b)

    def tail(self, b: ForwardBatch) -> None:
        """Verify the prefix again (stray writes during the forward, fingerprints), check every
        write target was written (its HEAD mark gone), then record the fingerprints of the slots
        just written. Capturable on the fused (CUDA) path. Where the forward has the side stream
        (``overlap``: inside a capture, or ALWAYS) it starts TAIL there unless ``start_tail`` did,
        then joins it: after ``tail`` the current stream is ordered after every check of the forward."""
        self.route.tail(b)

    # --- sweeps and holds ----------------------------------------------------------------------

    def hold(self, slots: torch.Tensor) -> None:
        """Slots (int64, this pool's numbering) the prefix cache holds that no request reads: the
        next HEAD reports a write into one of them as READ_CONFLICT naming the cache (row 0), a
        HEAD replayed from a CUDA graph included (the Triton check reads them counted on the
        device: ``runtime.holds``); at most one step's: ``end_step`` drops those no HEAD read. On
        CUDA, host slots never wait for queued device work: they go through pinned memory."""
        if not self.config.enabled:
            return
        check_slots("hold slots", slots, flat=False)  # any shape: held as flattened
        t0 = time.perf_counter()
        self.holds.hold(slots)
        self.totals.seconds += time.perf_counter() - t0

    def sweep_due(self, step: int) -> bool:
        check_int("step", step)
        return self.config.enabled and self.config.sweep_interval > 0 and step % self.config.sweep_interval == 0

    def entry_bytes(self) -> int:
        return self.sweeper.entry_bytes()

    def sweep(self, runs: Sequence[SweepRun], budget_bytes: int | None = None, *, hold: bool = False) -> int:
        """Verify up to the byte budget of ``runs`` (continuing where the last sweep stopped; runs
        that fit the budget are verified whole, from the first), fingerprints included. Always
        launches, even with nothing to sweep. Returns the number of slots queued for checking.
        ``hold``: also hold every slot of ``runs`` for the next HEAD (``hold`` of their
        concatenation), taken from the entries the sweep built."""
        check_runs(runs, budget_bytes)
        return self.sweeper.sweep(runs, budget_bytes, hold)

    def prefetch_sweep(self, runs: Sequence[SweepRun]) -> int:
        """Build the entries of ``runs`` now, so that the next ``sweep`` finds them built and
        converts only the runs that changed or came since (a sweep keeps each run's entries while
        the run is unchanged: ``RunCache``). For the step before a sweep, where the host waits for
        the device anyway: after a replayed forward's launch, before the sampling reads its
        result (pass runs with their slots on the host there: a device run's copy back would wait
        for the forward). Verifies, holds and launches nothing, touches no record; returns the
        entries of ``runs``."""
        return self.sweeper.prefetch(runs)

    def verify_landed(self, slots: torch.Tensor, first_position: int | None = None) -> int:
        """Check slots just filled by a copy: each against the one before it (consecutive positions)
        and its fingerprint; the first one's link is checked by the next HEAD that reads it.
        ``first_position``: the position the first landed record holds, where the caller has its
        bytes on the host (else it is read from the device)."""
        check_slots("verify_landed slots", slots, self.state.num_slots)
        if type(first_position) is int:  # other types: refused by the sweeper, naming the call
            check_int("verify_landed first_position", first_position)
        return self.sweeper.verify_landed(slots, first_position)

    # --- rows that travel with K/V -------------------------------------------------------------

    def export_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``slots`` (uint8[n, ROW_BYTES]: each slot's 32-byte record, then its 8-byte
        source-tag side word) to travel with their K/V, together with ``signature`` (what the rows
        mean; the receiver's ``import_rows`` takes it). Raises KVCanaryError for a slot outside
        the pool."""
        check_slots("export_rows slots", slots, self.state.num_slots, on_device=True)
        return self.rows.export(slots)

    def land_rows(self, slots: torch.Tensor, rows: torch.Tensor, signature: LayoutSignature) -> None:
        """Write rows of ``export_rows`` into ``slots`` (records and side words), unverified.
        ``signature``: the sending canary's ``signature``, shipped with the rows. Raises
        KVCanaryError, before anything is written, for a signature that differs from this
        canary's (naming each differing field with both values), rows that are not
        uint8[len(slots), ROW_BYTES] and a slot outside the pool."""
        check_slots("land_rows slots", slots, self.state.num_slots, on_device=True)
        self.rows.land("land_rows", slots, rows, signature)

    def import_rows(self, slots: torch.Tensor, rows: torch.Tensor, signature: LayoutSignature) -> None:
        """Write rows that travelled with K/V (``export_rows``, with the sender's ``signature``)
        into ``slots`` (the stamps are content-only, so they stay valid in any slot), then verify
        the landed slots at once (SWEEP). Raises as ``land_rows``, before anything is written."""
        check_slots("import_rows slots", slots, self.state.num_slots, on_device=True)
        self.rows.import_(slots, rows, signature)

    def attach_host_tier(self, tier: int | HostMirror) -> None:
        """Keep a host mirror of records for a host offload tier (call once, before the first
        ``offload``): a new one of ``tier`` rows (an int), or another canary's ``host_mirror``
        (a host tier shared by pools, or one that outlives its canary), adopted only where its
        signature equals this canary's: KVCanaryError naming the differing fields otherwise,
        before anything is attached."""
        self.rows.attach_host_tier(tier)

    def row_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The canary's rows for an engine that moves K/V between its pool and its host tier with a
        batched copy of its own: (device, host) pairs of uint8 views, [num_slots, w] and [num_rows,
        w], of the records (w = 32) and their side words (w = 8). With an offload's K/V, copy
        ``device[device_slots]`` into ``host[host_rows]`` (what ``offload`` does); with a load-back's,
        ``host[host_rows]`` into ``device[device_slots]``, then call ``rows_landed``. Copy between
        steps (``end_step`` joins the canary's side stream), on the stream the canary runs on.
        Raises KVCanaryError before ``attach_host_tier``."""
        return self.rows.row_pairs()

    def rows_landed(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """The engine copied the mirror's host rows ``host_rows[i]`` into ``device_slots[i]`` with
        their K/V (``row_pairs``): the landed slots are verified at once (SWEEP), as after
        ``load_back``. Raises KVCanaryError without a host tier or for mismatched rows, before
        anything is read."""
        self.rows.rows_landed(device_slots, host_rows)

    def offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Records follow K/V from ``device_slots[i]`` (int64[n]) to host row ``host_rows[i]`` (int64[n]).
        Raises KVCanaryError without a host tier (``attach_host_tier``) or for mismatched rows.
        Slots on the host cost less on CUDA: their range check reads them there (on the device it
        waits for a reduction and its copy back)."""
        self.rows.offload(device_slots, host_rows)

    def load_back(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Records follow K/V from host row ``host_rows[i]`` back to ``device_slots[i]``; verified at
        once. Raises KVCanaryError without a host tier (``attach_host_tier``) or for mismatched rows."""
        self.rows.load_back(host_rows, device_slots)

    def slots_freed(self, slots: torch.Tensor) -> None:
        """The engine returned ``slots`` (int64[n]) to its allocator: their open incidents close,
        so damage found after the slots are reused is a new incident. Call it where the engine
        frees slots (never inside a captured region)."""
        if self.config.enabled:
            self.incidents.note(self.ctx.step.step, slots, "freed")

    def slots_quarantined(self, num_slots: int) -> None:
        """The engine took ``num_slots`` damaged slots out of its prefix cache and host tier
        (quarantine): counted in ``totals.quarantined_slots`` (metrics, run report). Raises
        ValueError for a negative or non-int count."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.totals.quarantined_slots += num_slots

    # --- after each step ---------------------------------------------------------------------

    def end_step(self, step: int) -> StepReport:
        """Snapshot this step's counters, decode what the device reported (one step late on CUDA),
        apply the policy, feed the watchdog, print the stats line when due. Raises CanaryViolation
        under the raise policy and WatchdogTimeout when checks stopped (raise and recompute)."""
        check_int("step", step)
        return self.step_end.end_step(step)

    def flush(self, step: int) -> StepReport:
        """Read everything still pending (end of a run); blocks until the device is done."""
        check_int("step", step)
        return self.step_end.flush(step)

    def counters(self) -> dict:
        """Device counters as of the last snapshot read: launches, checked and stamped slots by point."""
        return self.step_end.counters()

    def stats_line(self, step: int) -> str:
        return self.step_end.stats_line(step)
