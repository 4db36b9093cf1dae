"""Wire a Canary into the reference engine through its public hooks, as any engine would.

HEAD is fed in ``before_forward`` (after a sweep when one is due: the token-truth scatter) and
launched in ``forward_prologue``, TAIL launched in ``forward_epilogue`` (both captured with the
model under CUDA graphs; on CUDA, with one pool, TAIL starts on the canary's side stream from
``layer_done`` of the last covered layer and ``forward_epilogue`` joins it), the step's report
in ``after_forward``, so on the CPU a violation is known before the step samples: under the
recompute policy the affected requests are retracted there and produce no token from the
corrupted forward. Under the raise policy the requests that read the damage fail there instead
(``Engine.fail``: status FAILED, slots quarantined), the step completes for the others, and
``after_step`` raises the ``CanaryViolation`` naming them; the engine stays usable. Under every
policy the slots a report names as damaged then leave the prefix cache and the host tier
(``Engine.quarantine``), counted in the canary's ``totals.quarantined_slots``. After a
replayed forward's launch, the step before a sweep, ``after_forward`` also builds the sweep's
runs (``Canary.prefetch_sweep``): the host waits for the replay there anyway. Offload and
load-back move the records with the K/V rows.

A model with sliding-window layers gets a second Canary for the window pool
(``PoolKind.SWA``, its window): it reads the batch through the pool's full-slot -> window-slot
table (``ForwardBatch.slot_lut``), so HEAD verifies only the last ``window`` positions of each
prefix and stamps through the table, and its sweeps see only cached slots that still hold a
window slot. Its violations join the step's report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import Half, LaunchPoint, PoolKind, Reason
from kvcanary.engine.hooks import EngineHooks
from kvcanary.errors import CanaryViolation
from kvcanary.ops.fingerprint import KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry, Recovery, StepReport
from kvcanary.runtime.policy import acts, merge_recoveries
from kvcanary.runtime.sweep import SweepRun

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine


def pool_sources(engine: Engine, config: CanaryConfig, pool: PoolKind = PoolKind.FULL) -> list[KVSource]:
    """KV sources of the covered layers and halves that live in ``pool`` (default: the first and
    last layer of that pool: full-attention layers for FULL, sliding-window layers for SWA)."""
    mc = engine.model_config
    n = mc.num_layers
    own = mc.full_layers if pool is PoolKind.FULL else mc.window_layers
    layers = config.layers if config.layers is not None else tuple(dict.fromkeys((own[0], own[-1])))
    for layer in layers:
        if not 0 <= layer < n:
            raise ValueError(f"CanaryConfig.layers has {layer}, outside the model's [0, {n}) layers")
    buffers = {Half.K: engine.pool.k_buffers, Half.V: engine.pool.v_buffers}
    return [KVSource.from_buffer(buffers[h][layer], half=h, layer=layer)
            for layer in layers if layer in own for h in config.halves]


def pool_geometry(engine: Engine, num_slots: int) -> PoolGeometry:
    """The geometry of a canary over one of ``engine``'s pools: its slots and page table, and the
    layout its rows carry in their signature (page size, K/V dtype, heads, head dim, the model:
    the reference model is named by what draws its weights)."""
    cfg, mc = engine.config, engine.model_config
    model = (f"reference-llama layers={mc.num_layers} hidden={mc.hidden} heads={mc.num_heads} "
             f"vocab={mc.vocab_size} seed={mc.seed}")
    return PoolGeometry(num_slots, cfg.max_rows, cfg.max_ctx, str(engine.device), page_size=cfg.page_size,
                        kv_dtype=mc.dtype, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, model=model)


def _runs(mask: torch.Tensor) -> list[slice]:
    """Slices of the maximal runs of True in a bool[n] mask."""
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(slice(start, i))
            start = None
    return out


def window_runs(runs: Sequence, lut: torch.Tensor) -> list[SweepRun]:
    """Sweep runs of the window pool: the stretches of ``runs`` (full-pool cached runs) whose
    slots still hold a window slot, translated through ``lut`` (int64, CPU)."""
    out = []
    for r in runs:
        win = lut[r.slots.to("cpu", torch.int64)]
        prev = int(lut[r.prev_slot]) if r.prev_slot > 0 else 0
        for run in _runs(win > 0):
            before = int(win[run.start - 1]) if run.start else prev
            tokens = list(r.token_ids[run]) if r.token_ids is not None else None
            out.append(SweepRun(win[run].to(r.slots.device), tokens, r.start_position + run.start, before or -1))
    return out


class CanaryHooks(EngineHooks):
    """EngineHooks that drive a Canary. Build the engine with ``hooks=CanaryHooks(config)`` and
    call ``hooks.attach(engine)`` (``attach_canary`` does both)."""

    def __init__(self, config: CanaryConfig):
        self.config = config
        self.engine: Engine | None = None
        self.canary: Canary | None = None
        self.window_canary: Canary | None = None  # the sliding-window pool's, if the model has one
        self.tail_layer: int | None = None  # the layer after whose attention TAIL starts (``layer_done``)
        self.step = 0
        self._sweep_every = config.sweep_interval if config.enabled else 0  # steps between sweeps (0: none)
        self.reads_token_truth = config.enabled and config.truth  # the engine builds each forward's truth then
        # build a sweep's runs after the replayed forward of the step before it (``after_forward``)
        self.prefetch_sweeps = True
        self.reports: list[StepReport] = []
        self._window_batches: tuple[ForwardBatch, ForwardBatch] | None = None  # (batch, its window-pool twin)
        self.failure: CanaryViolation | None = None  # raised by ``after_step`` (raise policy)
        self._quarantined = 0  # the engine's quarantined slots already counted in the canary's totals

    def attach(self, engine: Engine) -> Canary:
        cfg = engine.config
        self.engine = engine
        sources = pool_sources(engine, self.config)
        self.canary = Canary(self.config, pool_geometry(engine, cfg.num_slots), sources=sources)
        engine.delivery.lag = self.canary.reporter.lag  # tokens wait until their step's report was read
        if engine.host_tier is not None:
            self.canary.attach_host_tier(cfg.host_tier_slots)
            # the records travel in the pool's own copy of the K/V rows (one gather, one copy a move)
            engine.pool.move_with_kv(self.canary.row_pairs())
        window = engine.pool.window
        if window is not None:
            wgeo = pool_geometry(engine, window.num_slots)
            self.window_canary = Canary(self.config, wgeo, sources=pool_sources(engine, self.config, PoolKind.SWA),
                                        pool=PoolKind.SWA, window=window.window)
            if engine.host_tier is not None:
                self.window_canary.attach_host_tier(cfg.host_tier_slots)
            # one breakdown of the run's violations by reason and launch point (metrics: by pool too)
            wt, t = self.window_canary.totals, self.canary.totals
            wt.by_reason, wt.by_launch_point, wt.by_label = t.by_reason, t.by_launch_point, t.by_label
        elif self.canary.side is not None:  # TAIL beside the rest of the forward, from its last covered layer on
            full = engine.model_config.full_layers
            self.tail_layer = max((s.layer for s in self.canary.sources), default=full[-1])
        return self.canary

    def _window_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with the window pool's slot table, built (and checked) once per batch: its
        prologue, epilogue and report get the same object (the CPU path reuses its views)."""
        lut = self.engine.pool.window.lut
        cached = self._window_batches
        if cached is not None and cached[0] is batch and cached[1].slot_lut is lut:
            return cached[1]
        wb = dataclasses.replace(batch, slot_lut=lut)
        self._window_batches = (batch, wb)
        return wb

    # The per-step hooks call each canary by name, not through ``_canaries``' list, and ask
    # ``sweep_due`` and ``_handle`` only where they have work: an engine calls them between its
    # model's launches, where each Python call costs µs (its code is out of the caches).

    def before_forward(self, batch: ForwardBatch) -> None:
        canary, window = self.canary, self.window_canary
        if self._sweep_every and self.step % self._sweep_every == 0:  # ``Canary.sweep_due``, written out
            runs = self.engine.prefix_cache_slots()  # SweepRuns already, each node's own slots and key
            # and held for this step's HEAD: no write may land in an idle cached slot
            canary.sweep(runs, hold=True)
            if window is not None:
                wruns = window_runs(runs, self.engine.pool.window.translate(torch.arange(self.engine.config.num_slots)))
                window.sweep(wruns, hold=True)
        eager = not self.engine.replaying  # an eager forward's HEAD takes its truth scatter into its launch
        canary.prepare_head(batch, eager)
        if window is not None:
            window.prepare_head(self._window_batch(batch), eager)

    def forward_prologue(self, batch: ForwardBatch) -> None:
        self.canary.launch_head(batch)
        if self.window_canary is not None:
            self.window_canary.launch_head(self._window_batch(batch))

    def layer_done(self, batch: ForwardBatch, layer: int) -> None:
        if layer == self.tail_layer:
            self.canary.start_tail(batch)

    def forward_epilogue(self, batch: ForwardBatch) -> None:
        self.canary.tail(batch)
        if self.window_canary is not None:
            self.window_canary.tail(self._window_batch(batch))

    def _canaries(self, batch: ForwardBatch) -> list[tuple[Canary, ForwardBatch]]:
        """Each canary with the batch as its pool sees it."""
        if self.window_canary is None:
            return [(self.canary, batch)]
        return [(self.canary, batch), (self.window_canary, self._window_batch(batch))]

    def after_forward(self, batch: ForwardBatch) -> None:
        report, raised = _read(self.canary.end_step, self.step)
        if self.window_canary is not None:
            window, raised_too = _read(self.window_canary.end_step, self.step)
            report, raised = self._merge_window(report, window), raised or raised_too
        if raised:  # raise policy: fail the requests that read the damage now; ``after_step`` raises
            self.failure = self._fail(report)
        if self.failure is None and (report.violations or report.alarms or report.recovery is not None):
            self._handle(report)  # (a clean step: nothing to handle)
        if report.violations:
            self.quarantine(report.violations)
        every = self._sweep_every
        if every and self.engine.replaying and (self.step + 1) % every == 0 and self.prefetch_sweeps:
            # the step before a sweep, its forward a replay still running on the device: the host waits
            # for it at the sampling, so the sweep's runs are built here instead of ahead of the next forward
            self.canary.prefetch_sweep(self.engine.prefix_cache_slots())

    def _handle(self, report: StepReport, keep: bool = True) -> None:
        """Keep (``keep``) a report that found something; under recompute, redo what its recovery
        names."""
        if keep and (report.violations or report.alarms):
            self.reports.append(report)
        if report.recovery is not None:
            self.engine.apply_recovery(report.recovery)

    def _damaged_slots(self, violations: Sequence) -> list[int]:
        """The full-pool slots ``violations`` name as damaged (bad entries name none; a window
        pool's slot counts as the full slot that owns it), sorted."""
        damaged = [v for v in violations if v.slot > 0 and not v.reasons & Reason.BAD_ENTRY]
        slots = {v.slot for v in damaged if v.tag.pool is not PoolKind.SWA}
        window = [v.slot for v in damaged if v.tag.pool is PoolKind.SWA]
        if window:  # the window pool's slots: the full slots that own them
            slots.update(self.engine.pool.window.full_slots_of(window))
        return sorted(slots)

    def quarantine(self, violations: Sequence) -> None:
        """Quarantine the slots ``violations`` name as damaged (``Engine.quarantine``; every policy,
        called after each report that has violations; a no-op for slots already out of the cache)
        and count in the canary's ``totals.quarantined_slots`` what the engine took out since the
        last call (``Engine.fail`` and ``recompute`` quarantine too)."""
        before = self._quarantined
        # raise and recompute retire the pages for good; log, which keeps serving, only until freed
        self.engine.quarantine(torch.tensor(self._damaged_slots(violations), dtype=torch.int64),
                               retire=acts(self.config.policy))
        self._quarantined = self.engine.stats.num_quarantined_slots
        if self._quarantined > before:
            self.canary.slots_quarantined(self._quarantined - before)

    def _fail(self, report: StepReport) -> CanaryViolation | None:
        """The raise policy's violations of ``report``: the requests that read the damage fail
        (``Engine.fail``), the damaged slots are quarantined; returns the error naming them, or
        None when the report holds no news (damage already quarantined, read again by requests
        already failed: with reports a step late, the step that failed them read it once more)."""
        vs = report.violations
        slots = self._damaged_slots(vs)
        fresh = [s for s in slots if not self.engine.pool.is_quarantined(s)]
        reqs = [r for r in dict.fromkeys(r for v in vs for r in v.requests) if isinstance(r, int)]
        failed = self.engine.fail(reqs, torch.tensor(slots, dtype=torch.int64), min(v.step for v in vs))
        if not failed and not fresh and slots:
            return None
        names = ", ".join(map(str, failed)) or "none"
        return CanaryViolation(f"{len(vs)} KV-cache violation(s); failed requests: {names}; first: {vs[0].line()}",
                               vs, tuple(failed))

    def _merge_window(self, report: StepReport, window: StepReport) -> StepReport:
        """One report of the step: the window pool's violations and alarms join the full pool's;
        its recovery names the full slots that own the damaged window slots."""
        report.violations += window.violations
        report.alarms += window.alarms
        if window.recovery is not None:
            wrec = window.recovery
            slots = self.engine.pool.window.full_slots_of(wrec.slots)
            report.recovery = merge_recoveries(report.recovery, Recovery(wrec.requests, tuple(slots), wrec.since_step))
        return report

    def flush(self, step: int, keep: bool = False) -> StepReport:
        """Read everything the canaries still have pending (end of a run, or an idle server with
        tokens waiting for their report; blocks on the device): the full pool's report with the
        window pool's merged in. Its recovery is applied (the requests it names are re-queued),
        then every output still held back is delivered. ``keep``: also keep it in ``reports`` (a
        server that goes on stepping; a run reads the returned report instead)."""
        report, raised = _read(self.canary.flush, step)
        if self.window_canary is not None:
            window, raised_too = _read(self.window_canary.flush, step)
            report, raised = self._merge_window(report, window), raised or raised_too
        failure = self._fail(report) if raised else None
        if failure is None:
            self._handle(report, keep)  # its recovery re-queues what it names (raise: a re-detection is kept)
        if report.violations:
            self.quarantine(report.violations)
        self.engine.delivery.advance(step, flush=True)  # every step's report is in: the rest may go out
        if failure is not None:
            raise failure
        return report

    def window_report(self) -> dict | None:
        """The window pool's counters (positions translated, slid out, ...) and its canary's, or
        None without a window pool."""
        if self.window_canary is None:
            return None
        c, t = self.window_canary.counters(), self.window_canary.totals
        return {**self.engine.pool.window.counters(), "protected_slots": c["HEAD"]["stamped"],
                "verified_slots": sum(c[p.name]["checked"] for p in LaunchPoint), "sweeps": t.sweeps,
                "violations": max(c["ring_total"], t.violations)}

    def after_step(self, step_index: int) -> None:
        self.step = step_index + 1
        failure, self.failure = self.failure, None
        if failure is not None:  # the step is done, its failed requests ended: the engine stays usable
            raise failure

    def before_move(self) -> None:
        # the pool's copy reads and writes records on the engine's stream: after any side-stream
        # work still unjoined (a forward that raised before its TAIL joined)
        self.canary.join()

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        # the full pool's records were copied with the K/V (``KVPool.move_with_kv``)
        if self.window_canary is not None:  # window records follow the window K/V the pool offloaded
            win = self.engine.pool.window.translate(device_slots)
            has = win > 0
            self.window_canary.offload(win[has], host_rows.cpu()[has])

    def on_free(self, slots: torch.Tensor) -> None:
        # incidents of freed slots close (the window pool's close when its slots are stamped again)
        self.canary.slots_freed(slots)

    def on_retire(self, slots: torch.Tensor) -> None:
        self.canary.slots_freed(slots)  # quarantined slots their last holder let go: their incidents close

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.canary.rows_landed(device_slots, host_rows)  # landed with the K/V; verified at once
        if self.window_canary is not None:
            win, rows = self.engine.pool.window.translate(device_slots), host_rows.cpu()
            for run in _runs(win > 0):  # each run of consecutive positions is verified as it lands
                self.window_canary.load_back(rows[run], win[run].to(device_slots.device))


def _read(end, step: int) -> tuple[StepReport, bool]:
    """``end(step)`` (a canary's ``end_step`` or ``flush``) and whether the raise policy raised:
    its ``CanaryViolation`` comes back as the report of its violations (the canary accounted
    them before it raised), so the engine fails the requests that read the damage, not itself."""
    try:
        return end(step), False
    except CanaryViolation as e:
        return StepReport(step, list(e.violations)), True


def attach_canary(engine_factory, config: CanaryConfig):
    """Build an engine with a canary: ``engine_factory(hooks)`` returns the Engine. Returns (engine, hooks)."""
    hooks = CanaryHooks(config)
    engine = engine_factory(hooks)
    hooks.attach(engine)
    return engine, hooks
