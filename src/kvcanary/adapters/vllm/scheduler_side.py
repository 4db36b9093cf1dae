"""The scheduler half of the adapter: token truth, fresh blocks, sweeps and quarantine.

It runs beside vLLM's scheduler (the engine-core process) and sees what the workers cannot: the
requests' token ids, which blocks the block pool just handed out, which blocks its prefix cache
holds. Every step it sends the workers a ``StepMessage`` (``build``); every step it takes their
``WorkerReport`` back (``absorb``) and evicts the blocks they found damaged from the prefix cache,
so that damage is never served to another request (quarantine, under every policy).

Host work a step: for each scheduled request its new token ids (its whole history only the first
time it runs, or again after a preemption), and, every ``sweep_interval`` steps, the token ids of
the cached runs a sweep verifies (at most ``sweep_budget_bytes`` worth of slots).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from kvcanary.adapters.vllm.messages import CanaryStats, StepMessage, WorkerReport
from kvcanary.adapters.vllm.settings import AdapterSettings

log = logging.getLogger("kvcanary")

MAX_RUNS = 4096  # finished requests' cached runs remembered for sweeps (oldest dropped first)
ENTRY_BYTES = 64  # a sweep's cost per slot, for sizing what one sweep is sent


class SchedulerSide:
    def __init__(self, settings: AdapterSettings, block_sizes: list[int], max_num_seqs: int,
                 layout: tuple[tuple, ...] = ()):
        self.settings = settings
        self.block_sizes = block_sizes
        self.layout = layout  # per KV cache group, what the blocks it sends mean (``messages.layout_words``)
        self.step = 0
        self.requests: dict[str, object] = {}  # request id -> vLLM Request (its token ids grow in place)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs, 0, -1))  # row 0 is the padding row
        # finished requests' full cached blocks of group 0, with the block hash each had then
        self.runs: OrderedDict[str, tuple[list[int], list[object], list[int]]] = OrderedDict()
        # runs whose tokens the workers hold (run id -> its block count then), and runs they may drop
        self.sent: dict[str, int] = {}
        self.dropped: list[str] = []
        self.block_pool = None
        self.kv_cache_manager = None
        self.quarantined = 0
        self.unreported = 0  # quarantined blocks not yet in the Prometheus counters
        self.host_seconds = 0.0  # wall time spent building step messages
        self.prefix_hits = 0  # requests whose first forward read prefix-cache blocks
        self.preemptions = 0

    def bind(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = kv_cache_manager.block_pool

    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def _row(self, req_id: str) -> int:
        row = self.rows.get(req_id)
        if row is None:
            if not self.free_rows:
                raise RuntimeError(f"kv-canary: no free canary row for request {req_id} "
                                   f"({len(self.rows)} requests hold one); more requests run than max_num_seqs")
            row = self.rows[req_id] = self.free_rows.pop()
        return row

    def _release(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def build(self, so) -> StepMessage:
        """The message of the step ``so`` (a SchedulerOutput) schedules."""
        start = time.perf_counter()
        msg = self._build(so)
        self.host_seconds += time.perf_counter() - start
        return msg

    def _build(self, so) -> StepMessage:
        self.step += 1
        for rid in so.finished_req_ids:
            self._release(rid)
        for rid in so.preempted_req_ids or ():
            self._release(rid)  # a resumed request starts its truth again, in a new row
            self.preemptions += 1
        msg = StepMessage(self.step, fresh_blocks=[[] for _ in self.block_sizes],
                          gone=[*so.finished_req_ids, *(so.preempted_req_ids or ())], layout=self.layout)
        scheduled = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            self._release(nr.req_id)
            c, n = nr.num_computed_tokens, scheduled[nr.req_id]
            tokens = self._tokens(nr.req_id, 0, c + n, nr.prompt_token_ids)
            msg.requests[nr.req_id] = (self._row(nr.req_id), 0, tokens)
            msg.blocks[nr.req_id] = (True, [list(ids) for ids in nr.block_ids])
            self.prefix_hits += c > 0
            for g, ids in enumerate(nr.block_ids):
                msg.fresh_blocks[g].extend(ids[c // self.block_sizes[g]:])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            c, n = cached.num_computed_tokens[i], scheduled[rid]
            resumed = rid in cached.resumed_req_ids or rid not in self.rows
            if resumed:
                self._release(rid)
            start = 0 if resumed else c
            msg.requests[rid] = (self._row(rid), start, self._tokens(rid, start, c + n))
            new = cached.new_block_ids[i]
            if new is not None:
                msg.blocks[rid] = (resumed, [list(ids) for ids in new])
                for g, ids in enumerate(new):
                    msg.fresh_blocks[g].extend(ids[c // self.block_sizes[g]:] if resumed else ids)
        if self.settings.sweep_interval and self.step % self.settings.sweep_interval == 0:
            msg.sweep = self._sweep_runs()
        msg.sweep_dropped, self.dropped = self.dropped, []
        return msg

    def _tokens(self, req_id: str, start: int, end: int, fallback=None) -> list[int]:
        request = self.requests.get(req_id)
        ids = request.all_token_ids if request is not None else fallback
        if ids is None:
            raise RuntimeError(f"kv-canary: no token ids for request {req_id}")
        return list(ids[start:end])

    # --- sweeps and quarantine --------------------------------------------------------------

    def request_finished(self, request, block_ids: list[int]) -> None:
        """Remember the request's full blocks the prefix cache holds (group 0), for sweeps."""
        rid = request.request_id
        self.requests.pop(rid, None)
        self._release(rid)
        if self.block_pool is None:
            return
        bs = self.block_sizes[0]
        blocks, hashes = [], []
        for bid in block_ids:
            h = self.block_pool.blocks[bid].block_hash
            if h is None:
                break
            blocks.append(bid)
            hashes.append(h)
        if blocks:
            self.runs[rid] = (blocks, hashes, list(request.all_token_ids[: len(blocks) * bs]))
            while len(self.runs) > MAX_RUNS:
                self._drop(next(iter(self.runs)))

    def _drop(self, rid: str) -> None:
        del self.runs[rid]
        if self.sent.pop(rid, None) is not None:
            self.dropped.append(rid)

    def _sweep_runs(self) -> list[tuple[str, list[int], list[int] | None]]:
        """The cached runs still held as they were (the longest prefix of each whose blocks keep
        their hash), up to the sweep budget, as (run id, blocks, tokens); tokens are None where the
        workers already hold them. The runs sent go to the back of the queue."""
        if self.block_pool is None:
            return []
        bs = self.block_sizes[0]
        budget = max(self.settings.sweep_budget_bytes // ENTRY_BYTES, bs)
        chosen, sent = [], 0
        for rid in list(self.runs):
            blocks, hashes, tokens = self.runs[rid]
            keep = 0
            for bid, h in zip(blocks, hashes, strict=True):
                if self.block_pool.blocks[bid].block_hash is not h:
                    break
                keep += 1
            if not keep:
                self._drop(rid)
                continue
            if keep < len(blocks):  # its tail was evicted: the run is its still-cached prefix from now on
                self.runs[rid] = (blocks[:keep], hashes[:keep], tokens[: keep * bs])
            chosen.append(rid)
            sent += keep * bs
            if sent >= budget:
                break
        out = []
        for rid in chosen:
            blocks, _, tokens = self.runs.pop(rid)
            self.runs[rid] = (blocks, _, tokens)
            out.append((rid, blocks, None if self.sent.get(rid) == len(blocks) else tokens))
            self.sent[rid] = len(blocks)
        return out

    def absorb(self, report: WorkerReport | None) -> None:
        """Quarantine: the blocks the workers found damaged leave the prefix cache now."""
        if report is None or self.kv_cache_manager is None:
            return
        blocks = set().union(*report.damaged.values()) if report.damaged else set()
        if not blocks:
            return
        self.kv_cache_manager.evict_blocks(blocks)
        self.quarantined += len(blocks)
        self.unreported += len(blocks)
        for rid in [r for r, (bl, _, _) in self.runs.items() if blocks.intersection(bl)]:
            self._drop(rid)
        log.warning("kv-canary: %d damaged block(s) left the prefix cache: %s", len(blocks), sorted(blocks))

    def take_stats(self) -> CanaryStats | None:
        if not self.unreported:
            return None
        stats, self.unreported = CanaryStats(data={"quarantined_blocks": self.unreported}), 0
        return stats
