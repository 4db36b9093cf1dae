"""The engine: requests in, one forward per step, tokens out.

``step()`` = schedule (admit, evict/offload, load back, preempt) -> build the ``ForwardBatch``
-> ``hooks.before_forward`` -> ``hooks.forward_prologue`` -> model (writes and reads the paged
KV) -> ``hooks.forward_epilogue`` -> ``hooks.after_forward`` (with ``EngineConfig.cuda_graph``,
prologue + model + epilogue of a decode step replay as one CUDA graph: ``cuda_graph.py``) ->
sample -> finish (finished requests enter the prefix cache) -> deliver -> ``hooks.after_step``.
With reports read a step late (``delivery``), a replayed step delivers right after
``after_forward`` instead, while the device runs the replay: what it delivers is the same.
``EngineConfig.bugs`` switches on real-bug re-creations (``kvcanary.engine.zoo``); ``Engine.zoo``
logs their acts.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.engine.cache_manager import CacheManager
from kvcanary.engine.config import EngineConfig, ModelConfig, SamplerKind
from kvcanary.engine.cuda_graph import DecodeGraphs
from kvcanary.engine.delivery import Delivery
from kvcanary.engine.forward_batch import build_forward_batch
from kvcanary.engine.hooks import EngineHooks
from kvcanary.engine.host_tier import HostTier
from kvcanary.engine.model import TinyLlama
from kvcanary.engine.pool import KVPool
from kvcanary.engine.radix import RadixCache
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.sampler import Sampler, SamplingParams
from kvcanary.engine.scheduler import Schedule, Scheduler
from kvcanary.engine.stats import EngineStats
from kvcanary.engine.zoo import Bug, InFlightWrite, Zoo
from kvcanary.errors import CapacityError, ConfigError
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.jitter import Jitter
from kvcanary.runtime.policy import Recovery
from kvcanary.runtime.sweep import SweepRun


@dataclass(frozen=True)
class StepResult:
    step_index: int  # -1 when there was nothing to run
    request_ids: tuple[int, ...] = ()  # requests that advanced, in batch order
    new_tokens: dict[int, int] = field(default_factory=dict)  # request id -> token sampled this step
    finished_ids: tuple[int, ...] = ()
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # request id -> [vocab] it sampled from
    batch: ForwardBatch | None = None


class Engine:
    def __init__(
        self,
        model_config: ModelConfig | None = None,
        engine_config: EngineConfig | None = None,
        hooks: EngineHooks | None = None,
    ):
        self.model_config = model_config or ModelConfig()
        self.config = config = engine_config or EngineConfig()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"EngineConfig.device is {config.device!r} but CUDA is not available; use 'cpu'"
            )
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.stats = EngineStats()
        self.zoo = Zoo(config.bugs)
        self.pool = KVPool(self.model_config, config, self.hooks)
        self.tree = RadixCache(config.page_size, self.zoo) if config.enable_prefix_cache else None
        self.host_tier = None
        if config.host_tier_slots:
            self.host_tier = HostTier(self.pool, self.tree, config.host_tier_slots, self.stats, self.zoo)
        self.cache = CacheManager(self.pool, self.tree, self.host_tier, self.stats, self.zoo)
        self.scheduler = Scheduler(config, self.cache, self.stats, self.model_config.vocab_size, self.zoo)
        self.model = TinyLlama(self.model_config, config.max_ctx, self.device)
        self.sampler = Sampler(config.sampler, self.model_config.vocab_size)
        self.requests: dict[int, Request] = {}
        # token truth only for hooks that read it (a canary's): the canary-off engine builds none
        self.token_truth = bool(self.hooks.reads_token_truth)
        self.graphs = (DecodeGraphs(config.graph_batch_sizes, config.appends_truth and self.token_truth)
                       if config.cuda_graph else None)
        self.replaying = False  # whether this step's forward is a graph replay (set before ``before_forward``)
        self.jitter = Jitter(config.jitter_seed, config.jitter_ns, 4, self.device) if config.jitter_ns else None
        self.step_index = 0
        self.delivery = Delivery()  # a canary's hooks set its lag to the canary's report lag
        self.early_delivery = True  # with a lag, a replayed step delivers behind its replay (``step``)
        self._next_id = 0
        self._late_writes: list[InFlightWrite] = []  # zoo (Bug.ABORT_INFLIGHT_WRITE)

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], max_new_tokens: int, request_id: int | None = None,
        sampling: SamplingParams | None = None,
    ) -> int:
        """Queue a request; returns its id. ``sampling``: how it picks its tokens (None: greedy;
        without a seed it gets a random one, kept, so a recompute redraws the same tokens; needs
        the greedy sampler kind). Raises ValueError for bad arguments and CapacityError when it
        could never fit (``max_ctx`` or the pool)."""
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model_config.vocab_size
        if not prompt or not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt_ids must be a non-empty list of ids in [0, {vocab}), got {prompt[:16]}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        total, cfg = len(prompt) + max_new_tokens, self.config
        if total > cfg.max_ctx or -(-total // cfg.page_size) * cfg.page_size > cfg.num_usable_slots:
            raise CapacityError(
                f"len(prompt_ids) + max_new_tokens = {total} exceeds max_ctx ({cfg.max_ctx}) or the "
                f"pool's {cfg.num_usable_slots} usable slots; shorten the request or raise "
                "EngineConfig.max_ctx / num_slots"
            )
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
            if self.config.sampler is not SamplerKind.GREEDY and not sampling.is_greedy:
                raise ValueError(f"sampling with temperature {sampling.temperature} needs EngineConfig.sampler "
                                 f"'greedy' (the {self.config.sampler.value} sampler ignores the logits)")
            if sampling.seed is None:
                sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id} is already in use; pass a new id or None")
        req = Request(request_id, prompt, max_new_tokens, sampling=sampling)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _get(self, request_id: int) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"unknown request_id {request_id}; known ids come from add_request")
        return self.requests[request_id]

    def abort(self, request_id: int) -> bool:
        """Abort a waiting or running request, freeing all it holds (``on_free``). False if it had
        already finished or been aborted."""
        req = self._get(request_id)
        if req.status in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED):
            return False
        own = req.slots[req.num_prefix_cached : req.num_cached]
        if Bug.ABORT_INFLIGHT_WRITE in self.zoo and req.status is RequestStatus.RUNNING and own.numel():
            # zoo: its last K/V write is still in flight and is not waited for before the free
            self._late_writes.append(InFlightWrite.capture(self.pool, own))
        self.scheduler.abort(req)
        self.stats.num_aborts += 1
        return True

    def output_ids(self, request_id: int) -> list[int]:
        return list(self._get(request_id).output_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # --- running ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one scheduling step and its forward; see the module docstring for the hook order.
        Raises CapacityError when requests wait but nothing can be scheduled."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_work:
                raise CapacityError(
                    f"{len(self.scheduler.waiting)} requests wait but none fits: "
                    f"{self.pool.num_free_slots} free and {self.pool.num_quarantined_slots} quarantined "
                    f"slots of {self.config.num_usable_slots}"
                )
            return StepResult(step_index=-1)
        batch = build_forward_batch(plan, self.pool.req_to_token, *self._padding(plan), zoo=self.zoo,
                                    appends=self.config.appends_truth, truth=self.token_truth)
        batch_reqs = [req for req, _ in plan]
        graphed = None
        if self.graphs is not None:  # a size's first decode step captures its graph (nothing runs then)
            graphed = self.graphs.load(batch, lambda b: self._device_step(b, static=True))
        if self.jitter is not None:
            self.jitter.draw()
        if graphed is not None:
            batch = graphed
        self.replaying = graphed is not None
        self.hooks.before_forward(batch)
        logits = self.graphs.replay(batch) if graphed is not None else self._device_step(batch, _widths(plan))
        self.hooks.after_forward(batch)
        # with reports read a step late, the step before's report is in now (``after_forward``): its
        # tokens may go out while the device still runs this step's replay, instead of after the sampling
        early = self.replaying and self.delivery.lag > 0 and self.early_delivery
        if early:
            self.delivery.advance(self.step_index)
        if self._late_writes:
            self._land_late_writes(batch)
        # a hook may have retracted requests (recompute policy): they produce nothing this step
        plan = [(req, n) for req, n in plan if req.status is RequestStatus.RUNNING]
        logits = logits[[i for i, req in enumerate(batch_reqs) if req.status is RequestStatus.RUNNING]]
        for req, n in plan:
            if n == 1 + len(req.draft_ids) and req.num_cached >= len(req.prompt_ids):
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += n
        rows = [i for i, (req, n) in enumerate(plan) if req.num_cached + n == req.num_tokens + len(req.draft_ids)]
        reqs = [plan[i][0] for i in rows]
        tokens = self.sampler.sample(logits[rows], [r.request_id for r in reqs], [r.num_tokens for r in reqs],
                                     [r.sampling for r in reqs])
        new_tokens = {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}
        accepted = {r.request_id: self.sampler.accept_drafts(r.request_id, r.num_tokens, r.draft_ids)
                    for r in reqs if r.draft_ids}
        # the slots each one held (kept with a lag): a request's slot tensor is replaced when it grows or
        # shrinks, never written in place, so the reference stays this step's slots
        held = {r.request_id: r.slots for r in reqs} if self.delivery.lag else {}
        finished = self.scheduler.postprocess(plan, new_tokens, self.step_index, accepted)
        for r in reqs:  # a late report may name the slots they read, whatever they hold by then
            self.delivery.sampled(r, held.get(r.request_id), self.step_index)
        if not early:  # (tokens sampled now wait ``lag`` steps: nothing more is due this step)
            self.delivery.advance(self.step_index)
        self.stats.num_steps += 1
        self.step_index += 1
        self.hooks.after_step(self.step_index - 1)  # last: under raise it may raise, the step done
        return StepResult(
            step_index=self.step_index - 1,
            request_ids=batch.request_ids,
            new_tokens=new_tokens,
            finished_ids=tuple(r.request_id for r in finished),
            logits={r.request_id: logits[i] for r, i in zip(reqs, rows, strict=True)},
            batch=batch,
        )

    def _device_step(self, batch: ForwardBatch, widths: tuple[int, int] | None = None,
                     static: bool = False) -> torch.Tensor:
        """The device half of a step: prologue hooks, the model, epilogue hooks, with jitter points
        between them. ``widths``: the batch's (longest sequence, longest extend), from the plan
        (``_widths``); ``static``: keys over a fixed ``max_ctx`` window (capture). Either way the
        forward makes no host sync: an eager one would wait there for the device to run all that
        the prologue launched (a canary's HEAD) before it launches the model's first kernel."""
        spin = self.jitter.spin if self.jitter is not None else lambda point: None
        if static:
            widths = (self.config.max_ctx, 1)
        max_len, max_extend = widths if widths is not None else (None, 1)
        spin(0)
        self.hooks.forward_prologue(batch)
        spin(1)
        logits = self.model.forward(batch, self.pool, max_len=max_len, max_extend=max_extend,
                                    layer_done=lambda layer: self.hooks.layer_done(batch, layer))
        spin(2)
        self.hooks.forward_epilogue(batch)
        spin(3)
        return logits

    def _padding(self, plan: Schedule) -> tuple[int, int]:
        """(padding requests, their slot) of a decode-only batch padded to ``graph_batch_sizes``."""
        sizes, bs = self.config.graph_batch_sizes, len(plan)
        is_decode = all(n == 1 and req.num_cached >= len(req.prompt_ids) for req, n in plan)
        fits = [b for b in sizes if b >= bs]
        if not (is_decode and fits and fits[0] > bs):
            return 0, 0
        if Bug.PADDING_WRITES_LIVE_SLOT not in self.zoo:
            return fits[0] - bs, 0
        # zoo: PADDING_SLOT_ID = -1, and the cache write takes it for the pool's last slot
        last = self.config.num_slots - 1
        self.zoo.record(Bug.PADDING_WRITES_LIVE_SLOT, f"{fits[0] - bs} padding lanes write slot -1 = {last}", [last])
        return fits[0] - bs, -1

    def _land_late_writes(self, batch: ForwardBatch) -> None:
        """Zoo (``Bug.ABORT_INFLIGHT_WRITE``): an aborted request's in-flight write lands after the
        first forward that wrote one of its slots for their new owner."""
        written = set(batch.out_cache_loc.tolist())
        for late in [w for w in self._late_writes if written & set(w.slots.tolist())]:
            late.land(self.pool)
            self._late_writes.remove(late)
            self.zoo.record(Bug.ABORT_INFLIGHT_WRITE, f"write of an aborted request landed on slots "
                            f"{late.slots.tolist()[:8]}... after their new owner wrote them", late.slots)

    def run_until_done(self, max_steps: int | None = None) -> int:
        """Step until no request waits or runs (or ``max_steps``); returns the steps run."""
        steps = 0
        while self.has_unfinished and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
    ) -> dict[int, list[int]]:
        """Add ``prompts``, run until done, return request id -> output ids."""
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        ids = [self.add_request(p, n) for p, n in zip(prompts, limits, strict=True)]
        self.run_until_done()
        return {i: self.output_ids(i) for i in ids}

    # --- instrumentation --------------------------------------------------------------------

    def prefix_cache_slots(self) -> list[SweepRun]:
        """Every device-resident prefix-cache node no running request reads (lock count 0): its
        slots (int64 on the CPU, where the tree keeps them: a sweep builds its plan on the host),
        tokens, first position and predecessor slot (-1 at a sequence head), as the runs a sweep of
        idle cached slots takes."""
        if self.tree is None:
            return []
        root = self.tree.root
        runs, stack = [], list(root.children.values())
        while stack:  # ``RadixCache.nodes`` written out: parents before children
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            if node.slots is None or node.lock_count:  # on the host, or read by a running request
                continue
            # a node's run kept on it while it and its parent keep the same slot tensors unwritten, key and
            # start (a split, a revival or an in-place write makes it again): the tensor read of the
            # predecessor slot is most of what a run costs to make
            slots, parent = node.slots, node.parent
            above = parent.slots if parent is not root else None  # a split gives the node a new parent and slots
            kept = node.sweep_run
            if (kept is not None and kept[0] is slots and kept[1] == slots._version and kept[2] is above
                    and (parent is root or kept[3] == above._version)
                    and kept[4].token_ids is node.key and kept[4].start_position == node.start):
                runs.append(kept[4])
                continue
            prev = int(above[-1]) if parent is not root else -1  # a device node's parent is on the device
            run = SweepRun(slots, node.key, node.start, prev)  # the node's own tuple: kept by a sweep
            node.sweep_run = (slots, slots._version, above, above._version if above is not None else 0, run)
            runs.append(run)
        return runs

    def apply_recovery(self, recovery: Recovery) -> list[int]:
        """What the recompute policy decided (``Recovery``), applied: the requests it names that
        this engine still knows re-prefill, its slots are quarantined (``recompute``). Returns the
        ids retracted."""
        known = [r for r in recovery.requests if r in self.requests]
        return self.recompute(known, torch.tensor(recovery.slots, dtype=torch.int64), since_step=recovery.since_step)

    def recompute(self, request_ids: Sequence[int], bad_slots: torch.Tensor | Sequence[int],
                  since_step: int | None = None) -> list[int]:
        """Quarantine ``bad_slots`` (``quarantine``; they are freed as their readers are
        retracted) and make the named running requests, and any running request whose slots include
        a bad one, re-prefill from prompt + outputs, forgetting outputs sampled at ``since_step``
        or later (they may have read corrupted K/V; none of them was delivered, see ``delivery``).
        With reports one step late, the requests that read a bad slot at ``since_step`` or later
        (``delivery.holding``) count as named, and a named request that finished or was
        preempted since, without its outputs delivered, drops them and is re-queued the same way;
        one aborted since drops them and stays aborted.
        Safe to call from ``after_forward``: retracted requests produce nothing in the current
        step. Returns the ids retracted."""
        bad = torch.as_tensor(bad_slots, dtype=torch.int64).flatten().cpu()
        if bad.numel() and not bool(((bad >= 0) & (bad < self.config.num_slots)).all()):
            raise ValueError(f"bad_slots must lie in [0, {self.config.num_slots}), got {bad.tolist()[:16]}")
        bad = bad[bad >= self.config.page_size]  # page 0 is reserved and never handed out
        named = {self._get(i).request_id for i in request_ids}
        bad_set = set(bad.tolist())
        if since_step is not None:  # reports one step late: who read a bad slot since, not yet delivered
            named |= {i for i in self.delivery.holding(bad_set, since_step) if i in self.requests}  # (still known)
        affected = [
            r for r in self.scheduler.running if r.request_id in named or bad_set & set(r.slots.tolist())
        ]
        self.quarantine(bad)  # before the retraction frees them: counted, and never cached by it
        for req in reversed(affected):
            self.scheduler.retract(req)
            if since_step is not None:
                req.drop_outputs_since(since_step)
                self.delivery.dropped(req)
        if since_step is not None:  # finished, preempted or aborted since, not delivered yet (late reports)
            for rid in sorted(named):
                req = self.requests[rid]
                if req.status is RequestStatus.ABORTED:  # its client is gone: drop, never deliver
                    req.drop_outputs_since(since_step)
                    self.delivery.dropped(req)
                    continue
                if req.status in (RequestStatus.FINISHED, RequestStatus.PREEMPTED) \
                        and any(s >= since_step for s in req.output_steps) \
                        and not self.delivery.is_delivered(req, since_step):
                    req.drop_outputs_since(since_step)
                    self.delivery.dropped(req)
                    if req.status is RequestStatus.FINISHED:
                        req.status = RequestStatus.PREEMPTED
                        self.scheduler.waiting.appendleft(req)
                    affected.append(req)
        self.stats.num_recomputes += len(affected)
        return [r.request_id for r in affected]

    def fail(self, request_ids: Sequence[int], bad_slots: torch.Tensor | Sequence[int],
             since_step: int) -> list[int]:
        """The raise policy's answer to damage: quarantine ``bad_slots`` (as ``recompute`` does)
        and end with status FAILED the named requests, any running request whose slots include a
        bad one, and, with reports one step late, those that read a bad slot at ``since_step`` or
        later (``delivery.holding``); a named request that finished since fails too unless all its
        outputs were delivered. Their outputs sampled at ``since_step`` or later are dropped
        (never delivered); the rest of the engine goes on. Ids the engine no longer knows are
        skipped. Safe to call from ``after_forward``: failed requests produce nothing in the
        current step. Returns the ids failed, in order."""
        bad = torch.as_tensor(bad_slots, dtype=torch.int64).flatten().cpu()
        if bad.numel() and not bool(((bad >= 0) & (bad < self.config.num_slots)).all()):
            raise ValueError(f"bad_slots must lie in [0, {self.config.num_slots}), got {bad.tolist()[:16]}")
        bad = bad[bad >= self.config.page_size]  # page 0 is reserved and never handed out
        bad_set = set(bad.tolist())
        # a server drops the requests it is done with: ids it no longer knows are skipped
        named = {i for i in (*request_ids, *self.delivery.holding(bad_set, since_step)) if i in self.requests}
        named |= {r.request_id for r in self.scheduler.running if bad_set & set(r.slots.tolist())}
        self.quarantine(bad)  # before the failed requests free them: counted, and never cached
        failed = []
        for rid in sorted(named):
            req = self.requests[rid]
            if req.status in (RequestStatus.ABORTED, RequestStatus.FAILED):
                continue
            if req.status is RequestStatus.FINISHED and self.delivery.count(rid) == len(req.output_ids):
                continue  # delivered whole before the damage: nothing of it is wrong
            self.scheduler.abort(req)  # releases what it holds (nothing once finished)
            req.status = RequestStatus.FAILED
            req.drop_outputs_since(since_step)
            self.delivery.dropped(req)
            failed.append(rid)
        return failed

    def quarantine(self, bad_slots: torch.Tensor | Sequence[int], retire: bool = True) -> int:
        """Damage found in ``bad_slots`` (every policy): their pages leave the prefix cache and
        the host tier now, with everything cached after them, so no later request is served them
        (it misses there and recomputes); a running request reading them keeps them until it
        ends, never cached again. With ``retire`` their pages are never handed out again (freed,
        they are retired: ``on_retire``); without (the log policy: keep serving) owned pages
        return to the free list when freed and free ones stay there. Page 0 is skipped.
        Returns the slots newly quarantined (whole pages; counted in
        ``stats.num_quarantined_slots``). Raises ValueError for a slot outside the pool."""
        bad = torch.as_tensor(bad_slots, dtype=torch.int64).flatten().cpu()
        if bad.numel() and not bool(((bad >= 0) & (bad < self.config.num_slots)).all()):
            raise ValueError(f"bad_slots must lie in [0, {self.config.num_slots}), got {bad.tolist()[:16]}")
        num = self.cache.quarantine(bad[bad >= self.config.page_size], retire) * self.config.page_size
        self.stats.num_quarantined_slots += num
        return num

    def check_integrity(self) -> None:
        """Assert every host-side invariant: slot, row and host-row conservation, prefix-cache
        locks and placement, page tables vs slot records, request states."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        assert len(running) <= self.config.max_running, f"{len(running)} running > max_running"
        for r in running:
            assert r.status is RequestStatus.RUNNING and r.is_active, f"request {r.request_id} listed running"
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and not r.is_active, (
                f"request {r.request_id} is waiting but holds row {r.row} (status {r.status.name})"
            )
        listed = {id(r) for r in running} | {id(r) for r in waiting}
        for r in self.requests.values():
            assert id(r) in listed or r.status in (RequestStatus.FINISHED, RequestStatus.ABORTED,
                                                   RequestStatus.FAILED), (
                f"request {r.request_id} ({r.status.name}) is in no queue"
            )
        self.cache.check_integrity(list(self.requests.values()))


def _widths(plan: Schedule) -> tuple[int, int]:
    """(longest sequence, longest extend) of ``plan``'s forward, from the host's own counts: what
    ``AttentionLayout.from_batch`` would read back from the device. A padding request (one token at
    position 0) is never the longer one."""
    return max(req.num_cached + n for req, n in plan), max(n for _, n in plan)
