"""The Triton route: HEAD and TAIL as bound launches of ``check_forward``'s kernel
(``ops.bound.BoundCheck``: the canary's own arguments checked once), on CUDA or, with
``fused=True``, interpreted on the CPU.

Where the route goes further, decided here once:

| with                               | HEAD and TAIL                                           |
|------------------------------------|---------------------------------------------------------|
| ``eager_graphs`` (no window table) | an eager forward's as graph replays (``eager_graphs``)  |
| ``overlap`` (CUDA)                 | on a side stream of high priority, for captured forwards |
|                                    | (CAPTURED) or every one (ALWAYS); HEAD's write marks    |
|                                    | stay on the model's stream                              |
| a publishing reporter (CUDA)       | an eager TAIL publishes the counters from its launch    |

A bound launch refuses a batch it does not take (it launches nothing); ``check_forward`` then
runs it, which raises the error naming the argument. HEAD and TAIL are written out in full on
this route: an eager forward calls both between its model's launches, where each Python call
costs µs.
"""

from __future__ import annotations

import time

import torch

from kvcanary.config import Overlap
from kvcanary.core.record import LaunchPoint
from kvcanary.errors import KVCanaryError
from kvcanary.ops.backend import Backend
from kvcanary.ops.bound import BatchMemo, BoundCheck, BoundMarks
from kvcanary.ops.landed import mark_writes
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.eager_graphs import EagerGraphs
from kvcanary.runtime.forward import Forward
from kvcanary.runtime.reporting import Reporter


class TritonRoute(Forward):
    """HEAD and TAIL as bound Triton launches (see the module doc). ``bound``: each launch's
    ``BoundCheck`` ("head", "tail", "side_head"), None where one refuses the canary's own
    arguments (every call then takes ``check_forward``, which raises the error)."""

    truth_with_head = True

    def __init__(self, ctx, truth, truth_lens, holds, reporter: Reporter):
        super().__init__(ctx, truth, truth_lens, holds)
        config, dev = ctx.config, ctx.state.device
        self.reporter = reporter
        # a graph that captures TAIL also publishes the counters (runtime.snapshots): no copy per replay
        self.publishing = self.on_cuda and reporter.start_publishing()
        # high priority: where the model's programs fill every SM (large decode batches), the side
        # stream's blocks are scheduled as SMs free up rather than after the model's queued ones, so
        # the join after TAIL waits less (a captured graph keeps each kernel's stream priority)
        on_side = config.overlap is not Overlap.OFF and self.on_cuda
        self.side = torch.cuda.Stream(device=dev, priority=-1) if on_side else None
        self.side_eager = config.overlap is Overlap.ALWAYS
        if self.side is not None:
            self._device_index = self.side.device_index
            self._forked, self._joined = torch.cuda.Event(), torch.cuda.Event()
        self._side_captured = False  # side work launched inside a graph capture (joined inside it)
        self.tail_started = False
        self.bound = self._bind_checks()
        self.folds_scatter = self.bound is not None and "head" in self.bound
        self._bound_marks = None  # the side stream's HEAD: its write marks, on the model's stream
        if self.bound is not None and self.side is not None and self.sources:
            self._bound_marks = BoundMarks(ctx.state, self.sources, self.meta, config.real_kv)
        # an eager forward's HEAD and TAIL on the current stream as graph replays (on the CPU, the Triton
        # kernel interpreted, as launches over the same buckets)
        self.eager: EagerGraphs | None = None
        if config.eager_graphs and self.folds_scatter and not self.window:
            self.eager = EagerGraphs(self.bound["head"], self.bound["tail"],
                                     tags=(ctx.tags[LaunchPoint.HEAD], ctx.tags[LaunchPoint.TAIL]),
                                     held_words=holds.counted, publish=self.publishing,
                                     max_bs=config.max_bs, max_tokens=config.max_tokens, check=ctx.state.check)

    def _bind_checks(self) -> dict[str, BoundCheck] | None:
        """The ``BoundCheck`` of each launch: "head" (HEAD on the current stream, marking the write
        targets in the sources), "tail", and with a side stream "side_head" (HEAD on the side
        stream marks no source: ``mark_writes`` does, on the model's stream); None where one
        refuses the canary's own arguments."""
        memo = BatchMemo()  # a forward's TAIL finds its batch laid out as its HEAD found it

        def bind(stamp: bool, sources, publication=None) -> BoundCheck:
            return BoundCheck(self.state, stamp=stamp, sources=sources, mode=self.config.real_kv,
                              window=self.window, marks=self.marks if stamp else None, truth=self.truth,
                              truth_lens=self.truth_lens, memo=memo, publication=publication)

        pub = self.reporter.publication if self.publishing else None
        try:  # an eager TAIL publishes the counters from its own launch (``end_step`` then launches none)
            bound = {"tail": bind(False, self.kv, (pub.seq, pub.rows) if pub is not None else None)}
            if self.side is not None:
                bound["side_head"] = bind(True, ())
            if self.side is None or not self.side_eager:
                bound["head"] = bind(True, self.kv)
            return bound
        except KVCanaryError:
            return None

    def _checked(self, b: ForwardBatch, tag: int, launch: str, truth: bool, held=None, publish: bool = False,
                 scatter: bool = False) -> bool:
        """HEAD or TAIL of ``b`` through the bound ``launch`` (``held``: the counted held slots;
        ``publish``: TAIL publishing the counters; ``scatter``: HEAD scattering ``b``'s token
        truth first, whole histories or appends); False (nothing launched): call ``check_forward``."""
        bound = self.bound
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

    def join(self) -> None:
        """Order the current stream after the side-stream work. ``tail`` joins; so does every call
        that touches the canary's state on the current stream (so after a join an eager TAIL's
        publication no longer carries the counters)."""
        self.tail_current = False
        if not self.side_busy:
            return
        # a capture starts synchronised: eager side work needs no wait inside it (nor could have one)
        if torch.cuda.is_current_stream_capturing() == self._side_captured:
            self._joined.record(self.side)
            torch.cuda.current_stream(self._device_index).wait_event(self._joined)
        self.side_busy = False

    def fork(self) -> torch.cuda.Stream:
        """The side stream, ordered after everything launched so far on the current stream."""
        # one event each way, recorded again at every fork and join (a wait takes the record it
        # was queued behind), instead of the new event a stream's wait_stream makes every call
        self._forked.record(torch.cuda.current_stream(self._device_index))
        self.side.wait_event(self._forked)
        self.side_busy, self._side_captured = True, torch.cuda.is_current_stream_capturing()
        return self.side

    def launch_head(self, b: ForwardBatch) -> None:
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        # the small helpers (``_on_side``, ``use_truth``, ``lut``) written out on this path and TAIL's
        tag = self.ctx.tags[LaunchPoint.HEAD]
        capturing = self.on_cuda and torch.cuda.is_current_stream_capturing()  # asked once a HEAD
        on_side = self.side is not None and (self.side_eager or capturing)
        # the scatter ``prepare_head`` left to this HEAD: in its launch where it runs eagerly on the model's
        # stream; else (another batch's, a side-stream or captured HEAD) launched first, as it would have been
        given = self.scatter_for is b
        fold = given and not on_side and not capturing
        if self.scatter_for is not None and not fold:
            self.scatter_pending()
        truth = self.truth if self.config.truth and b.truth_offsets is not None else None
        if truth is not None and b.truth_starts is not None and not given:
            # appends ``prepare_head`` left to the graph (a captured forward, or one it was not told is eager),
            # on the current stream ahead of HEAD's checks: fixed sizes, so a replay appends on the device
            self.join()  # the last TAIL read the table
            self.scatter_device(b)
        if on_side:
            self._launch_head_overlapped(b, tag, truth, capturing)
        else:
            self._launch_head_here(b, tag, truth, capturing, fold)
        self.ctx.totals.seconds += time.perf_counter() - t0

    def _launch_head_here(self, b: ForwardBatch, tag: int, truth, capturing: bool, fold: bool) -> None:
        """HEAD on the current stream: replayed from an eager graph, the bound launch, or the op."""
        self.join()  # an eager HEAD after a side one (ALWAYS, or an unjoined capture): stream-ordered again
        self.tail_started = False
        holds = self.holds
        held = holds.now(capturing)
        self.scatter_for = None
        if self.eager is not None and not capturing and self.eager.head(b, truth is not None, fold):
            holds.held = None  # the replay read the counted words
            return
        if not self._checked(b, tag, "head", truth is not None, held, scatter=fold):
            if fold:
                self.scatter_device(b)
            self.check_op(b, tag, True, truth is not None, Backend.TRITON, sources=self.kv, marks=self.marks,
                              held_words=held)
        if not capturing:  # a capture consumes nothing now: the count stays for its replay or ``end_step``
            holds.held = None

    def _launch_head_overlapped(self, b: ForwardBatch, tag: int, truth, capturing: bool) -> None:
        """HEAD with ``overlap``: the write marks on the current stream, ahead of the forward's
        writes; the rest of HEAD (it reads no K/V, the forward reads no record) on the side stream.
        ``capturing``: whether the current stream is capturing."""
        self.join()  # the last TAIL is done: a reused write target never shows it this step's mark
        self.tail_started = False  # a forward that raised never reached its tail
        lut, held = self.lut(b), self.holds.now(capturing)  # the counted words
        with torch.cuda.stream(self.fork()):  # checks every input before it launches anything
            if not self._checked(b, tag, "side_head", truth is not None, held):
                self.check_op(b, tag, True, truth is not None, Backend.TRITON, marks=self.marks, held_words=held)
        if not capturing:
            self.holds.held = None
        if self.sources and not (self._bound_marks is not None and self._bound_marks(b.out_cache_loc, lut)):
            # inputs checked above; on the current stream, ahead of the forward's writes
            mark_writes(state=self.state, out_cache_loc=b.out_cache_loc, sources=self.sources, lut=lut, meta=self.meta,
                        mode=self.config.real_kv)

    def start_tail(self, b: ForwardBatch) -> None:
        if not self.config.enabled or self.tail_started or not self._on_side():
            return
        t0 = time.perf_counter()
        self._fork_tail(b, torch.cuda.is_current_stream_capturing())
        self.ctx.totals.seconds += time.perf_counter() - t0

    def _fork_tail(self, b: ForwardBatch, capturing: bool) -> None:
        with torch.cuda.stream(self.fork()):
            self._launch_tail(b, capturing)
        self.tail_started = True

    def _launch_tail(self, b: ForwardBatch, capturing: bool, publish: bool = False) -> None:
        """TAIL's launch on the current stream; ``capturing``: whether that stream is capturing;
        ``publish``: an eager TAIL on the model's stream publishes the counters from its launch."""
        tag, truth = self.ctx.tags[LaunchPoint.TAIL], self.config.truth and b.truth_offsets is not None
        if not self._checked(b, tag, "tail", truth, publish=publish):
            publish = False
            self.check_op(b, tag, False, truth, Backend.TRITON, sources=self.kv)
        if self.publishing and capturing:
            self.reporter.publish()  # each replay hands end_step its counters
            return
        self._tailed(publish)

    def _tailed(self, publish: bool) -> None:
        """After an eager TAIL on the current stream: its forward is no replay's; ``publish``: its
        launch published the counter block."""
        if self.replays:
            self.replays -= 1
        self.tail_current = publish
        if publish:
            self.reporter.published()

    def tail(self, b: ForwardBatch) -> None:
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        capturing = self.on_cuda and torch.cuda.is_current_stream_capturing()  # asked once a TAIL
        if self.tail_started or (self.side is not None and (self.side_eager or capturing)):  # ``_on_side``
            if not self.tail_started:
                self._fork_tail(b, capturing)
            self.tail_started = False
            self.join()
        elif self.eager is not None and not capturing and self.eager.tail(b):
            self._tailed(self.publishing)
        else:
            self._launch_tail(b, capturing, self.publishing and not capturing)
        self.ctx.totals.seconds += time.perf_counter() - t0

    def warm_up(self) -> None:
        """Both placements where a side stream serves (a captured forward takes it, an eager one
        under Overlap.CAPTURED the current stream), TAIL publishing and not where the route
        publishes; the launches themselves (a capture cannot compile)."""
        placements = sorted({self.side_eager, self.side is not None})
        publishing = sorted({False, self.publishing})
        side_eager, publishes, eager = self.side_eager, self.publishing, self.eager
        self.eager = None
        try:
            for self.side_eager in placements:
                self._warm_launches(publishing)
        finally:
            self.side_eager, self.publishing, self.eager = side_eager, publishes, eager
