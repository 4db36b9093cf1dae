"""Sweeps: idle slots (prefix-cache held, landed copies) verified within a byte budget.

``Sweeper.sweep(runs)`` verifies up to the budget of ``runs`` through one sweep plan, continuing
where the last sweep stopped; runs that fit the budget whole are verified from the first
(``_sweep_whole``). Which way a plan is loaded is fixed when the canary is built:

| where                      | the plan's load and verify                                     |
|----------------------------|----------------------------------------------------------------|
| CPU, numba                 | the compiled verify reads the entries' host arrays (no plan)   |
| CUDA, after the warm-up    | one graph replay per size class: copy, spread, count, verify (``sweep_graphs``) |
| CUDA, before it            | the entries staged in pinned words, one copy, the bound verify |
| elsewhere                  | the plan's columns filled, then ``verify``                     |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvcanary.core.record import RECORD_BYTES, LaunchPoint
from kvcanary.errors import KVCanaryError
from kvcanary.ops.bound import BoundVerify
from kvcanary.ops.plan import Plan
from kvcanary.ops.verify import verify
from kvcanary.runtime.context import CanaryContext
from kvcanary.runtime.cpu_forward import CpuForward
from kvcanary.runtime.forward import Forward
from kvcanary.runtime.holds import Holds
from kvcanary.runtime.sweep import RunCache, SweepRun, same_blocks, sweep_entries
from kvcanary.runtime.sweep_graphs import SweepGraphs, staging_words

log = logging.getLogger("kvcanary")


def _window_of(entries: np.ndarray) -> tuple | None:
    """(the array owning a sweep window's memory, its address, its length): equal for two windows
    that are the same entries of one ``RunCache`` array (which nothing writes; the kept window
    keeps its owner alive, so no other array takes that address). None for no array view."""
    base = entries.base if isinstance(entries, np.ndarray) else None
    if base is None:
        return None
    return base, entries.__array_interface__["data"][0], len(entries)


def _slots_of_runs(runs: Sequence[SweepRun]) -> np.ndarray:
    """Every slot of ``runs``, concatenated, as an int64 host array."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return torch.cat([r.slots.reshape(-1).to("cpu", torch.int64) for r in runs]).numpy()


class Sweeper:
    """The sweeps of one canary (see the module doc). ``forward``: the canary's route, joined
    before the plan is touched; ``cpu``: the compiled CPU path, where the route has one;
    ``bound``: the route's bound checks (CUDA: the sweep's verify is bound too)."""

    def __init__(self, ctx: CanaryContext, forward: Forward, holds: Holds, cpu: CpuForward | None = None):
        config, state = ctx.config, ctx.state
        self.ctx, self.config, self.state, self.forward, self.holds = ctx, config, state, forward, holds
        self.kv, self.cpu = ctx.kv, cpu
        dev = state.device
        self.plan = Plan.allocate(config.plan_capacity, 1, dev)
        self.plan.enable.fill_(1)  # a sweep plan never overflows: its loads cap the count
        self.cursor = 0
        self.runs = RunCache()  # the sweeps' runs as host arrays, kept while they are unchanged
        # the window of those arrays the plan holds (``_window_of``): a sweep over the same entries
        # launches the verify without staging or copying them again
        self._plan_window: tuple | None = None
        self._plan_blocks: list | None = None  # or those arrays' kept blocks, in order (``_sweep_whole``)
        # CUDA: pinned words a sweep's entries are copied from (packed by ``_staged``, or laid out by
        # the sweep's graphs), the device words they land in before they are spread into the plan's
        # columns, and the event of their last copy; made here, not at the first sweep, which would
        # pay the pinned allocation (about a ms)
        on_cuda = dev.type == "cuda"
        words = staging_words(self.plan.capacity)
        self._staging = torch.zeros(words, dtype=torch.int32, pin_memory=True) if on_cuda else None
        self._landing = torch.zeros(words, dtype=torch.int32, device=dev) if on_cuda else None
        self._staging_read = torch.Event(device=dev) if on_cuda else None  # recorded on the current stream in C++
        self.graphs: SweepGraphs | None = None  # the plan's load and verify as graphs (``warm_up``)
        # CUDA with the bound checks: the verify with its plan checked once, the six entry columns as one block
        self.bound_verify = BoundVerify(state, self.plan, ctx.kv) \
            if forward.bound is not None and on_cuda else None
        self.block = self.plan.entry_columns() if on_cuda else None

    def entry_bytes(self) -> int:
        fp = sum(4 * s.words_read(self.kv.mode) for s in self.kv.sources)
        return 2 * RECORD_BYTES + 16 + fp

    def sweep(self, runs: Sequence[SweepRun], budget_bytes: int | None = None, hold: bool = False) -> int:
        """``Canary.sweep``."""
        if type(hold) is not bool:
            raise KVCanaryError(f"sweep hold must be True or False, got {hold!r}")
        if not self.config.enabled:
            return 0
        t0 = time.perf_counter()
        totals = self.ctx.totals
        budget = self.config.sweep_budget_bytes if budget_bytes is None else budget_bytes
        n_max = min(budget // self.entry_bytes(), self.plan.capacity)
        if self.graphs is not None or self.cpu is not None:
            n = self._sweep_whole(runs, n_max, hold)
            if n is not None:
                totals.sweeps += 1
                totals.seconds += time.perf_counter() - t0
                return n
        start = self.cursor
        (slot, pred, pos, tok), self.cursor = sweep_entries(runs, start, n_max, self.runs)
        window = _window_of(slot)
        held = self._plan_window
        if window is not None and held is not None and window[0] is held[0] and window[1:] == held[1:]:
            self._verify_plan()  # the entries the plan holds: nothing to stage or copy
            n = window[2]
        else:
            n = self.load(slot, pred, pos, tok)
            if self.cpu is None:  # the plan holds them (the compiled CPU verify reads the host arrays)
                self._plan_window = window
        if hold:
            every = self.runs.last
            if every is not None and self.graphs is not None and n and n == every.shape[1] and start % n == 0:
                self.holds.hold_replayed(n, self.graphs.held, lambda: every[0])  # every slot, in order
            else:
                self.holds.hold_host(every[0] if every is not None else _slots_of_runs(runs))
        self.ctx.step.sweep_runs.append((slot, pos))
        totals.sweeps += 1
        totals.seconds += time.perf_counter() - t0
        return n

    def prefetch(self, runs: Sequence[SweepRun]) -> int:
        """``Canary.prefetch_sweep``."""
        if not self.config.enabled:
            return 0
        if isinstance(runs, torch.Tensor) or not isinstance(runs, Sequence):
            raise KVCanaryError(f"prefetch_sweep runs must be a sequence of SweepRun, got {type(runs).__name__}")
        for i, r in enumerate(runs):
            if type(r) is not SweepRun:
                raise KVCanaryError(f"prefetch_sweep runs[{i}] must be a SweepRun, got {type(r).__name__}")
        t0 = time.perf_counter()
        self.runs.entries(runs)
        self.ctx.totals.seconds += time.perf_counter() - t0
        return self.runs.total

    def _sweep_whole(self, runs: Sequence[SweepRun], n_max: int, hold: bool) -> int | None:
        """A sweep whose runs fit its budget whole: the same entries as ``sweep_entries`` takes,
        in run order from the first (every one is verified, so where the last sweep stopped does
        not matter), without cutting a window out of them. On CUDA, with the sweep's graphs,
        staged from each run's kept entries in one copy into the graphs' pinned rows, or verified
        again where the plan holds those very entries; on the CPU, the compiled verify reads the
        runs' joined arrays. None, with nothing done, where they do not fit."""
        cache = self.runs
        blocks = cache.entries(runs)
        n = cache.total
        if n > n_max:
            return None
        if self.cpu is not None:
            every = cache.concatenated(blocks)
            self.load(every[0], every[1], every[2], every[3])
            if hold:
                self.holds.hold_host(every[0])
            self.ctx.step.sweep_runs.append(blocks)
            return n
        self.forward.join()
        graphs, loaded = self.graphs, self._plan_blocks
        if loaded is not None and same_blocks(loaded, blocks):
            graphs.again()
        else:
            graphs.load_blocks(blocks, n)
            self._plan_window, self._plan_blocks = None, blocks
        if hold:  # every slot, in order: widened by the replay
            self.holds.hold_replayed(n, graphs.held, lambda: cache.concatenated(blocks)[0])
        self.ctx.step.sweep_runs.append(blocks)
        return n

    def load(self, slot, pred, pos, tok) -> int:
        """Load the sweep plan with entries (int64 host arrays or sequences) and verify it; more
        entries than the plan holds (a long landed copy) a plan's capacity at a time."""
        self.forward.join()
        self._plan_window = self._plan_blocks = None  # until ``sweep`` names the entries it loaded
        p, n = self.plan, len(slot)
        if n > p.capacity:
            for at in range(0, n, p.capacity):
                cut = slice(at, at + p.capacity)
                self.load(slot[cut], pred[cut], pos[cut], tok[cut])
            return n
        if self.cpu is not None and self.cpu.verify(slot, pred, pos, tok, self.ctx.tags[LaunchPoint.SWEEP]):
            return n  # the compiled verify of the entries themselves: no plan tensors filled
        graphs = self.graphs
        if graphs is not None:  # staged, then one replay: copy, spread, count, verify
            graphs.load((slot, pred, pos, tok), n)
            return n
        on_cuda = p.slot.device.type == "cuda"
        if n:
            self._fill(slot, pred, pos, tok, n, on_cuda)
        p.count.fill_(n)
        self._verify_plan()
        if n and on_cuda:
            self._staging_read.record()
        return n

    def _fill(self, slot, pred, pos, tok, n: int, on_cuda: bool) -> None:
        """The plan's entry columns from ``n`` host entries."""
        p, block = self.plan, self.block
        if block is not None:
            # five columns (entry = slot; row stays 0, no request: nothing else writes this plan's) in
            # one contiguous copy, then spread on the device: a copy of the [5, n] slice of the
            # columns straight from the host is strided, which torch stages through temporaries and
            # which waits for queued device work (H200: 380 µs behind a busy stream against 39)
            landing = self._landing[: 5 * n]
            landing.copy_(self._staged((slot, pred, pos, tok)), non_blocking=True)
            block[:5, :n].copy_(landing.view(5, n))
            return
        cols = (self._staged((slot, pred, pos, tok)).view(5, n) if on_cuda else
                torch.from_numpy(np.stack([np.asarray(v, dtype=np.int64) for v in (slot, pred, pos, tok,
                                                                                  slot)]).astype(np.int32)))
        for buf, vals in zip((p.slot, p.pred, p.position, p.token, p.entry), cols, strict=True):
            buf[:n].copy_(vals, non_blocking=on_cuda)
        p.row[:n].zero_()  # idle slots: no request

    def _verify_plan(self) -> None:
        """Verify the entries the sweep plan holds."""
        self.forward.join()
        tag = self.ctx.tags[LaunchPoint.SWEEP]
        if self.graphs is not None:  # the last load was a replay too: its words are still staged
            self.graphs.again()
        elif self.bound_verify is not None:  # enable: set once (nothing else writes this plan's)
            self.bound_verify(tag)
        else:
            self.plan.enable.fill_(1)
            verify(state=self.state, plan=self.plan, tag=tag, sources=self.kv)

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

    def verify_landed(self, slots: torch.Tensor, first_position: int | None = None) -> int:
        """``Canary.verify_landed``."""
        if first_position is not None and type(first_position) is not int:
            raise KVCanaryError(f"verify_landed first_position must be an int or None, got {first_position!r}")
        if not self.config.enabled or slots.numel() == 0:
            return 0
        s = slots.reshape(-1).to("cpu", torch.int64).numpy()
        first_pos = (int(self.state.records[int(s[0])].view(torch.int64)[1]) if first_position is None
                     else first_position)
        pos = np.arange(first_pos, first_pos + len(s), dtype=np.int64)
        self.ctx.step.sweep_runs.append((s, pos))
        return self.load(s, np.concatenate([[-1], s[:-1]]), pos, np.full(len(s), -1))

    def warm_up(self) -> None:
        """The verify's compile (an empty plan), then on CUDA the plan's load and verify captured
        as graphs, once; where the device cannot capture them, sweeps launch one by one, as
        without a warm-up."""
        self.load([], [], [], [])
        if (self.graphs is not None or self.bound_verify is None or self.block is None
                or torch.cuda.is_current_stream_capturing()):
            return
        tag = self.ctx.tags[LaunchPoint.SWEEP]
        verify_ = self.bound_verify
        try:
            self.graphs = SweepGraphs(self.plan, self.block, lambda: verify_(tag), self._staging,
                                      self._landing, self._staging_read, self.state.check)
        except RuntimeError as e:
            log.warning("kv_canary: sweeps launch one by one, their graphs could not be captured (%s)", e)
