"""Continuous batching: which requests extend by how many tokens this step.

Each step spends at most ``max_tokens_per_step`` tokens. Running requests go first, oldest
first: a decode extends by one token, a prefill (or re-prefill) by at most ``chunk_size``.
Then waiting requests are admitted in order while budget, rows and ``max_running`` allow.
When slots run short the prefix cache is evicted first (see ``CacheManager``); if that is not
enough the newest running request is preempted: it releases everything, is re-queued at the
front and later re-prefills its whole history (prompt + outputs). No request is admitted in a
step that preempted one. With ``num_draft_tokens``, a decode also writes that many speculative
drafts after its last token (fewer near ``max_new_tokens``); ``postprocess`` keeps the K/V of
the drafts the sampler accepted and frees the slots of the rejected ones.
"""

from __future__ import annotations

from collections import deque

from kvcanary.engine.cache_manager import CacheManager
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.sampler import draft_tokens
from kvcanary.engine.stats import EngineStats
from kvcanary.engine.zoo import Bug, Zoo

Schedule = list[tuple[Request, int]]  # (request, number of tokens it extends by), in batch order


class Scheduler:
    """``vocab_size`` bounds the ids of speculative drafts."""

    def __init__(self, config: EngineConfig, cache: CacheManager, stats: EngineStats, vocab_size: int,
                 zoo: Zoo | None = None):
        self.config, self.cache, self.stats, self.vocab_size = config, cache, stats, vocab_size
        self.zoo = zoo if zoo is not None else Zoo()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _extend_len(self, req: Request, budget: int) -> int:
        uncached = req.num_uncached
        if Bug.REPREFILL_PROMPT_ONLY in self.zoo and req.output_ids and req.num_cached < len(req.prompt_ids):
            uncached = len(req.prompt_ids) - req.num_cached  # zoo: the re-prefill is built from the prompt alone
        return min(uncached, self.config.chunk_size, budget)

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Drafts a decode of ``req`` writes after its last token (0 for a prefill)."""
        if n != 1 or req.num_uncached != 1 or req.num_cached < len(req.prompt_ids):
            return 0
        return max(min(self.config.num_draft_tokens, budget - 1, req.max_new_tokens - len(req.output_ids)), 0)

    def schedule(self) -> Schedule:
        """Pick this step's extends, reserving their slots. Side effects: eviction, offload,
        load-back and preemption (hooks ``on_offload``, ``on_load``, ``on_free``)."""
        self.cache.begin_step()
        plan: Schedule = []
        budget, preempted = self.config.max_tokens_per_step, False
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._extend_len(req, budget)
            num_drafts = self._num_drafts(req, n, budget)
            while not self.cache.reserve(req, req.num_cached + n + num_drafts):
                victim = self.running[-1]
                self.retract(victim)
                self.stats.num_preemptions += 1
                preempted = True
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                req.draft_ids = draft_tokens(req.request_id, req.num_tokens, num_drafts, self.vocab_size)
                plan.append((req, n + num_drafts))
                budget -= n + num_drafts
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

    def postprocess(self, plan: Schedule, sampled: dict[int, int], step: int = 0,
                    accepted: dict[int, list[int]] | None = None) -> list[Request]:
        """Account the extends of ``plan``, append ``sampled`` tokens (request id -> token, sampled
        at ``step``) and, for a decode with drafts, the tokens of the drafts it ``accepted`` (request
        id -> tokens after the sampled one); free the slots of rejected drafts; finish requests that
        reached ``max_new_tokens``. Returns the finished requests."""
        finished, accepted = [], accepted or {}
        for req, n in plan:
            num_drafts, req.draft_ids = len(req.draft_ids), []
            req.num_cached += n - num_drafts
            if Bug.REPREFILL_PROMPT_ONLY in self.zoo:
                self._skip_output_positions(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            extra = accepted.get(req.request_id, [])
            for t in [token, *extra]:
                req.output_ids.append(t)
                req.output_steps.append(step)
                if req.is_done:
                    break
            if num_drafts:
                req.num_cached = min(req.num_cached + len(extra), req.num_tokens - 1)
                self.cache.trim(req)
            if req.is_done:
                self.cache.release(req, cache=self.config.enable_prefix_cache)
                self.running.remove(req)
                req.status = RequestStatus.FINISHED
                finished.append(req)
        return finished

    def _skip_output_positions(self, req: Request) -> None:
        """Zoo (``Bug.REPREFILL_PROMPT_ONLY``): once a prompt-only re-prefill reaches the end of the
        prompt, the outputs' positions but the last are taken as computed."""
        if req.output_ids and req.num_cached == len(req.prompt_ids) < req.num_tokens - 1:
            skipped = range(req.num_cached, req.num_tokens - 1)
            req.num_cached = req.num_tokens - 1
            self.zoo.record(Bug.REPREFILL_PROMPT_ONLY, f"request={req.request_id} positions {skipped.start}.."
                            f"{skipped.stop - 1} taken as computed", request_id=req.request_id,
                            positions=range(skipped.start, skipped.stop + 1))  # and the decode that seeds from them
