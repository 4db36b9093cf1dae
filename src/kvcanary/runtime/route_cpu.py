"""The CPU route: the truth scatter with HEAD, and TAIL, as one compiled call each
(``runtime.cpu_forward``); a batch that call refuses takes ``check_forward`` on the compiled
kernel, which raises the error naming the argument."""

from __future__ import annotations

import time

from kvcanary.core.record import LaunchPoint
from kvcanary.ops.backend import Backend
from kvcanary.ops.check import check_forward
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.cpu_forward import CpuForward
from kvcanary.runtime.forward import Forward


class CpuRoute(Forward):
    """HEAD and TAIL of a CPU canary where numba serves (see the module doc); ``compiled``: the
    compiled per-forward path, which also verifies a sweep's entries."""

    def __init__(self, ctx, truth, truth_lens, holds, sources, meta, sweep_capacity: int):
        super().__init__(ctx, truth, truth_lens, holds, sources, meta)
        self.compiled = CpuForward(ctx.config, ctx.state, sources, meta, truth, truth_lens, ctx.window,
                                   sweep_capacity)

    def defer_scatter(self, b: ForwardBatch) -> bool:
        return self.compiled.defer_scatter(b)

    def _compiled(self, b: ForwardBatch, tag: int, stamp: bool) -> bool:
        """HEAD or TAIL through the compiled call; False: run the op (the truth scatter HEAD's
        call would have made, made first)."""
        if self.compiled.check(b, tag, stamp, self.use_truth(b), self.holds.held if stamp else None):
            return True
        pending = self.compiled.take_scatter()
        if pending is not None and self.use_truth(pending):
            self.scatter_truth(pending)
        return False

    def launch_head(self, b: ForwardBatch) -> None:
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        tag = self.ctx.tags[LaunchPoint.HEAD]
        if not self._compiled(b, tag, True):
            self.join()
            truth = self.use_truth(b)
            check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                          extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                          positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=True,
                          truth=self.truth if truth else None,
                          truth_lens=self.truth_lens[:b.batch_size] if truth else None, sources=self.sources,
                          mode=self.config.real_kv, meta=self.meta, lut=self.lut(b), window=self.window,
                          marks=self.marks, held=self.holds.held, backend=Backend.NUMBA)
        self.holds.held = None
        self.ctx.totals.seconds += time.perf_counter() - t0

    def tail(self, b: ForwardBatch) -> None:
        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        tag = self.ctx.tags[LaunchPoint.TAIL]
        if not self._compiled(b, tag, False):
            truth = self.use_truth(b)
            check_forward(state=self.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                          extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                          positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=False,
                          truth=self.truth if truth else None,
                          truth_lens=self.truth_lens[:b.batch_size] if truth else None, sources=self.sources,
                          mode=self.config.real_kv, meta=self.meta, lut=self.lut(b), window=self.window,
                          backend=Backend.NUMBA)
            self.tail_current = False
        self.replays = max(self.replays - 1, 0)
        self.ctx.totals.seconds += time.perf_counter() - t0
