"""Delivery: when a sampled token may reach the client.

A token sampled at step k may come from a forward that read or wrote damaged K/V; the canary
says so in the report of step k, which the engine reads ``lag`` steps later (0 on the CPU, where
the report is read before the step samples; 1 on CUDA, where it is read one step late). So a
token is *delivered* (appended to ``log``, streamed by a server) only once the report of the step
that sampled it has been read: the tokens a recompute drops (``Request.drop_outputs_since``) were
never delivered. ``retracted`` counts delivered tokens that were dropped anyway (it stays 0 when
``Recovery.since_step`` is right).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from kvcanary.engine.request import Request


class Delivered(NamedTuple):
    step: int  # the step after which it was delivered
    request_id: int
    index: int  # its index in the request's outputs
    token: int


class Delivery:
    """``keep_log``: append every delivered token to ``log`` (runs and tests read it); a server
    that runs for months turns it off and ``forget``s each request it is done with, so nothing
    here grows with the tokens or requests it ever served."""

    def __init__(self, lag: int = 0, keep_log: bool = True):
        self.lag, self.keep_log = lag, keep_log
        self.log: list[Delivered] = []
        self.retracted = 0
        self._count: dict[int, int] = {}  # request id -> outputs delivered
        self._pending: dict[int, Request] = {}  # requests with outputs not delivered yet
        # with a lag: the steps not delivered yet, oldest first, each with the slots every request that
        # sampled then held (int64 tensors, read only by ``holding``: a recompute; no per-step
        # conversion); a step's entry goes as a whole once it is delivered
        self._reads: deque[tuple[int, dict[int, object]]] = deque()

    def sampled(self, req: Request, slots=None, step: int = -1) -> None:
        """``req`` sampled at ``step`` holding ``slots`` (int64 tensor; kept only with a lag, for
        ``holding``)."""
        self._pending[req.request_id] = req
        if self.lag and slots is not None:
            reads = self._reads
            if not reads or reads[-1][0] != step:
                reads.append((step, {}))
            reads[-1][1][req.request_id] = slots

    def holding(self, slots: set[int], since: int) -> set[int]:
        """Requests with undelivered outputs sampled at ``since`` or later while holding one of
        ``slots`` (whatever they are now: running, preempted, finished)."""
        return {rid for s, held_by in self._reads if s >= since
                for rid, held in held_by.items() if not slots.isdisjoint(held.tolist())}

    def dropped(self, req: Request) -> None:
        """After ``req.drop_outputs_since``: count delivered outputs it no longer has."""
        n = self._count.get(req.request_id, 0)
        if len(req.output_ids) < n:
            self.retracted += n - len(req.output_ids)
            self._count[req.request_id] = len(req.output_ids)

    def count(self, request_id: int) -> int:
        """How many of the request's outputs were delivered (a client may have been sent them)."""
        return self._count.get(request_id, 0)

    @property
    def has_pending(self) -> bool:
        """Whether some sampled outputs wait for their step's report."""
        return bool(self._pending)

    def is_delivered(self, req: Request, step: int) -> bool:
        """Whether any output ``req`` sampled at ``step`` or later was delivered already."""
        n = self._count.get(req.request_id, 0)
        return any(s >= step for s in req.output_steps[:n])

    def advance(self, step: int, flush: bool = False) -> None:
        """Deliver the outputs sampled at ``step - lag`` or earlier (all of them with ``flush``)."""
        upto = step - self.lag
        reads = self._reads
        while reads and (flush or reads[0][0] <= upto):
            reads.popleft()
        for rid, req in list(self._pending.items()):
            n = self._count.get(rid, 0)
            while n < len(req.output_ids) and (flush or req.output_steps[n] <= upto):
                if self.keep_log:
                    self.log.append(Delivered(step, rid, n, req.output_ids[n]))
                n += 1
            self._count[rid] = n
            if n == len(req.output_ids):
                del self._pending[rid]

    def forget(self, request_id: int) -> None:
        """Drop what is kept of a request that left the engine (its count, its pending outputs)."""
        self._count.pop(request_id, None)
        self._pending.pop(request_id, None)

    def tokens(self) -> dict[int, list[int]]:
        """Request id -> its delivered tokens in order."""
        out: dict[int, list[int]] = {}
        for d in self.log:
            out.setdefault(d.request_id, []).append(d.token)
        return out
