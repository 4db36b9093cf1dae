"""Continuous batching: which requests extend by how many tokens this step.

Each step spends at most ``max_tokens_per_step`` tokens. Running requests go first, oldest
first: a decode extends by one token, a prefill (or re-prefill) by at most ``chunk_size``.
Then waiting requests are admitted in order while budget, rows and ``max_running`` allow.
When slots run short the prefix cache is evicted first (see ``CacheManager``); if that is not
enough the newest running request is preempted: it releases everything, is re-queued at the
front and later re-prefills its whole history (prompt + outputs). No request is admitted in a
step that preempted one.
"""

from __future__ import annotations

from collections import deque

from kvcanary.engine.cache_manager import CacheManager
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.stats import EngineStats

Plan = list[tuple[Request, int]]  # (request, number of tokens it extends by), in batch order


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, stats: EngineStats):
        self.config, self.cache, self.stats = config, cache, stats
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _extend_len(self, req: Request, budget: int) -> int:
        return min(req.num_uncached, self.config.chunk_size, budget)

    def schedule(self) -> Plan:
        """Pick this step's extends, reserving their slots. Side effects: eviction, offload,
        load-back and preemption (hooks ``on_offload``, ``on_load``, ``on_free``)."""
        plan: Plan = []
        budget, preempted = self.config.max_tokens_per_step, False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._extend_len(req, budget)
            while not self.cache.reserve(req, req.num_cached + n):
                victim = self.running[-1]
                self.retract(victim)
                self.stats.num_preemptions += 1
                preempted = True
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                plan.append((req, n))
                budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self.cache.admit(req):
                break
            n = self._extend_len(req, budget)
            if not self.cache.reserve(req, req.num_cached + n):
                self.cache.release(req, cache=False)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.stats.num_prefix_hit_tokens += req.num_prefix_cached
            plan.append((req, n))
            budget -= n
        return plan

    def retract(self, req: Request) -> None:
        """Release a running request's memory and re-queue it at the front to re-prefill its
        whole history (status PREEMPTED)."""
        self.cache.release(req, cache=False)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def abort(self, req: Request) -> None:
        """Drop a waiting or running request, releasing all it holds (status ABORTED)."""
        if req in self.running:
            self.cache.release(req, cache=False)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.ABORTED

    def postprocess(self, plan: Plan, sampled: dict[int, int], step: int = 0) -> list[Request]:
        """Account the extends of ``plan``, append ``sampled`` tokens (request id -> token, sampled
        at ``step``) and finish requests that reached ``max_new_tokens``. Returns the finished requests."""
        finished = []
        for req, n in plan:
            req.num_cached += n
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_ids.append(token)
            req.output_steps.append(step)
            if req.is_done:
                self.cache.release(req, cache=self.config.enable_prefix_cache)
                self.running.remove(req)
                req.status = RequestStatus.FINISHED
                finished.append(req)
        return finished
