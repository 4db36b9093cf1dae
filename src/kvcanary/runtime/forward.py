"""The forward: HEAD before the model runs, TAIL after it, and the token truth they read.

One object per execution path, chosen once when the Canary is built (``Canary._route``):

| route           | where                                 | HEAD and TAIL                               |
|-----------------|---------------------------------------|---------------------------------------------|
| ``CpuRoute``    | CPU, numba serving (``fused`` unset)  | one compiled call each (``route_cpu``)      |
| ``TritonRoute`` | CUDA (or ``fused=True``: interpreted) | bound launches of ``check_forward``'s       |
|                 |                                       | kernel, graph replays, a side stream        |
|                 |                                       | (``route_triton``)                          |
| ``OpsRoute``    | ``fused=False``, or no kernel         | the ops one by one (``route_ops``)          |

Every route falls back to the op (``check_forward`` or the ops) for a batch its fast path
refuses, which raises the error naming the argument. This base holds what every route shares:
``prepare_head`` (the batch remembered for the report, its truth scattered or left to HEAD),
the truth scatter itself, and the count of forwards whose TAIL did not run eagerly (``replays``,
which the reporter reads). Each route warms up its own launches (``warm_up``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvcanary.core.record import LaunchPoint
from kvcanary.errors import KVCanaryError
from kvcanary.ops.backend import HAS_TRITON, Backend
from kvcanary.ops.check import check_forward
from kvcanary.ops.conflicts import WriteMarks
from kvcanary.ops.scatter import scatter_req_token_ids, scatter_validated
from kvcanary.runtime.batch import BatchError, ForwardBatch
from kvcanary.runtime.context import CanaryContext
from kvcanary.runtime.holds import Holds
from kvcanary.runtime.warmup import empty_batch


class Forward:
    """HEAD and TAIL on one execution path (see the module doc). ``truth_with_head``: the truth
    scatter is launched with HEAD on the device (CUDA, or the Triton launch), not by
    ``prepare_head``; ``folds_scatter``: an eager HEAD takes its batch's scatter into its own
    launch."""

    truth_with_head = False
    folds_scatter = False
    publishing = False  # an eager TAIL publishes the counters from its launch (``TritonRoute``)
    side = None  # the side stream (``TritonRoute`` with ``overlap``)
    side_eager = False
    bound = None  # the bound launches (``TritonRoute``), which the sweeps' verify is bound beside
    eager = None  # an eager forward's HEAD and TAIL as graph replays (``TritonRoute``)
    plan = None  # the forward's plan (``OpsRoute``; the fused routes keep theirs in the device state)

    def __init__(self, ctx: CanaryContext, truth: torch.Tensor, truth_lens: torch.Tensor, holds: Holds):
        self.ctx, self.config, self.state, self.window = ctx, ctx.config, ctx.state, ctx.window
        self.truth, self.truth_lens = truth, truth_lens
        self._device_index_of_truth = truth.get_device()  # a batch's device is compared as this int
        self.holds, self.kv = holds, ctx.kv
        self.sources, self.meta = ctx.kv.list(), ctx.kv.meta  # for the ops that take them one by one
        self.marks = WriteMarks.allocate(ctx.state.num_slots, ctx.state.device)  # HEAD's write-conflict check
        self.on_cuda = ctx.state.device.type == "cuda"
        self.scatter_for: ForwardBatch | None = None  # the batch whose truth scatter HEAD's launch takes
        self.replays = 0  # forwards prepared since the last end_step whose TAIL did not run eagerly
        # the last publication, an eager TAIL's, carries the counters: nothing launched since (``join``)
        self.tail_current = False
        self.side_busy = False  # side work the current stream has not waited for yet

    def join(self) -> None:
        """Order the current stream after this route's side-stream work (none here); every call
        that touches the canary's state on the current stream joins first."""
        self.tail_current = False

    def launch_head(self, b: ForwardBatch) -> None:
        """HEAD's launches (``Canary.launch_head``), timed into the totals: the route's ``_head``
        (a route whose every µs counts writes this method out instead)."""
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        self._head(b, self.ctx.tags[LaunchPoint.HEAD])
        self.ctx.totals.seconds += time.perf_counter() - t0

    def tail(self, b: ForwardBatch) -> None:
        """TAIL (``Canary.tail``), timed into the totals: the route's ``_tail``."""
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        self._tail(b, self.ctx.tags[LaunchPoint.TAIL])
        self.ctx.totals.seconds += time.perf_counter() - t0

    def _head(self, b: ForwardBatch, tag: int) -> None:
        raise NotImplementedError

    def _tail(self, b: ForwardBatch, tag: int) -> None:
        raise NotImplementedError

    def start_tail(self, b: ForwardBatch) -> None:
        """TAIL beside the rest of the forward: only where the route has a side stream."""

    def defer_scatter(self, b: ForwardBatch) -> bool:
        """Leave ``b``'s truth scatter to its HEAD's own call; False: ``prepare_head`` scatters."""
        return False

    def prepare_head(self, b: ForwardBatch, eager: bool = False) -> None:
        """The host-fed half of HEAD (``Canary.prepare_head``)."""
        if type(eager) is not bool:
            raise KVCanaryError(f"prepare_head eager must be True or False, got {eager!r}")
        if not self.config.enabled:
            return
        if b.batch_size > self.config.max_bs:
            raise ValueError(f"batch size {b.batch_size} > CanaryConfig.max_bs ({self.config.max_bs}); raise max_bs")
        t0 = time.perf_counter()
        ctx = self.ctx
        self.tail_current = False  # the truth scatter writes the error flags
        if self.side_busy:
            self.join()  # a HEAD or TAIL left unjoined (a forward that raised) reads the truth table
        if self.scatter_for is not None:  # a forward that raised before its HEAD: its scatter, as it would have run
            self.scatter_pending()
        use_truth = self.config.truth and b.truth_offsets is not None  # ``use_truth``, without its call
        on_device = use_truth and self.truth_with_head
        if on_device:
            self._check_truth_batch(b)
        ctx.step.batch = b
        if ctx.incidents.open:  # a rewrite closes an open incident; nothing to track otherwise
            ctx.incidents.note(ctx.step.step, self.written(b), "rewritten")
        ctx.totals.forwards += 1  # here, not in tail: a graph replay runs launch_head and tail on the device only
        self.replays += 1  # until its TAIL runs eagerly
        if on_device:  # one launch that also writes truth_lens; checked when built
            if eager and self.folds_scatter:
                self.scatter_for = b  # HEAD's launch scatters (or ``launch_head`` first, where it cannot)
            elif b.truth_starts is None:  # appends: ``launch_head``'s, captured with the forward
                self.scatter_device(b)
        elif use_truth and not self.defer_scatter(b):  # CPU: in HEAD's call
            self.scatter_truth(b)
        ctx.totals.seconds += time.perf_counter() - t0

    def scatter_device(self, b: ForwardBatch) -> None:
        """``b``'s truth scatter launched alone (whole histories, or appends where ``b`` has
        starts), one launch that also writes truth_lens; its tensors checked when ``b`` was built
        and by ``_check_truth_batch``."""
        scatter_validated(b.truth_ids, b.truth_offsets, b.req_pool_indices, self.truth, self.state.error,
                          self.truth_lens, HAS_TRITON, b.truth_starts)

    def scatter_pending(self) -> None:
        """The scatter ``prepare_head`` left to a HEAD that is not taking it, launched now."""
        b, self.scatter_for = self.scatter_for, None
        self.join()
        self.scatter_device(b)

    def scatter_truth(self, b: ForwardBatch) -> None:
        scatter_req_token_ids(flat_in=b.truth_ids, offsets=b.truth_offsets, req_pool_indices=b.req_pool_indices,
                              pool_out=self.truth, error_flag=self.state.error, lens_out=self.truth_lens,
                              starts=b.truth_starts)

    def missed_eager_head(self) -> None:
        """``prepare_head(batch, eager=True)`` and no ``launch_head`` of the batch before ``end_step``:
        scatter its histories now (the table stays right from here on), then raise."""
        b = self.scatter_for
        self.scatter_pending()
        raise KVCanaryError(f"prepare_head(batch, eager=True) for a batch of {b.batch_size} requests, then end_step "
                            "with no launch_head of that batch: its truth histories were scattered only now, so a "
                            "graph replay in between read the table without them; pass eager=True only where "
                            "launch_head(batch) follows on the host")

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

    def check_op(self, b: ForwardBatch, tag: int, stamp: bool, truth: bool, backend: Backend, **extra) -> None:
        """HEAD (``stamp``) or TAIL of ``b`` through ``check_forward``, for a batch the route's fast
        path refused (the op raises the error naming the argument); ``truth``: against the token
        truth; ``extra``: the sources, marks and held slots, as the route passes them."""
        check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                      extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                      positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=stamp,
                      truth=self.truth if truth else None, truth_lens=self.truth_lens[:b.batch_size] if truth else None,
                      lut=self.lut(b), window=self.window, backend=backend, **extra)

    def use_truth(self, b: ForwardBatch) -> bool:
        return self.config.truth and b.truth_offsets is not None

    def lut(self, b: ForwardBatch) -> torch.Tensor | None:
        return b.slot_lut if self.window else None

    def written(self, b: ForwardBatch) -> torch.Tensor:
        """The slots of this pool the forward writes: ``out_cache_loc``, through the window table."""
        lut = self.lut(b)
        return b.out_cache_loc if lut is None else lut[b.out_cache_loc]

    def tag(self, point: LaunchPoint) -> int:
        return self.ctx.tags[point]

    # --- warm-up -------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Launch each of this route's HEAD and TAIL variants once on an empty batch (one padding
        request, nothing read, nothing written), so that no step pays a compile: with and
        without token truth, and a HEAD taking its batch's truth scatter (whole histories and
        appends) where HEAD's launch takes it. The caller restores the counters."""
        self._warm_launches((False,))

    def _warm_sizes(self) -> list[int]:
        """One batch size per variant: a fused check's variants do not depend on it."""
        return [1]

    def _warm_launches(self, publishing) -> None:
        geometry = (self.truth.shape[0], self.state.num_slots, self.window)
        for truth in sorted({False, bool(self.config.truth)}):
            for bs in self._warm_sizes():
                b = empty_batch(self.state.device, bs, truth, *geometry)
                self.launch_head(b)
                if truth and self.truth_with_head:  # an eager HEAD taking its truth scatter:
                    # whole histories, then appends (``prepare_head(b, eager=True)`` without counting a forward)
                    for fold in (b, dataclasses.replace(b, truth_starts=b.prefix_lens)):
                        self.scatter_for = fold
                        self.launch_head(fold)
                for self.publishing in publishing:
                    self.tail(b)
