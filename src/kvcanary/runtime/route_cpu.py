"""The CPU route: the truth scatter with HEAD, and TAIL, as one compiled call each
(``runtime.cpu_forward``); a batch that call refuses takes ``check_forward`` on the compiled
kernel, which raises the error naming the argument."""

from __future__ import annotations

from kvcanary.ops.backend import Backend
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.cpu_forward import CpuForward
from kvcanary.runtime.forward import Forward


class CpuRoute(Forward):
    """HEAD and TAIL of a CPU canary where numba serves (see the module doc); ``compiled``: the
    compiled per-forward path, which also verifies a sweep's entries."""

    def __init__(self, ctx, truth, truth_lens, holds, sweep_capacity: int):
        super().__init__(ctx, truth, truth_lens, holds)
        self.compiled = CpuForward(ctx.config, ctx.state, ctx.kv, truth, truth_lens, ctx.window, sweep_capacity)

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

    def _head(self, b: ForwardBatch, tag: int) -> None:
        if not self._compiled(b, tag, True):
            self.join()
            self.check_op(b, tag, True, self.use_truth(b), Backend.NUMBA, sources=self.kv, marks=self.marks,
                          held=self.holds.held)
        self.holds.held = None

    def _tail(self, b: ForwardBatch, tag: int) -> None:
        if not self._compiled(b, tag, False):
            self.check_op(b, tag, False, self.use_truth(b), Backend.NUMBA, sources=self.kv)
            self.tail_current = False
        self.replays = max(self.replays - 1, 0)
