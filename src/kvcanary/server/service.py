"""The reference engine as a service: one thread owns the engine and steps it; the event loop
talks to it through commands and awaits ``Generation`` handles.

| who            | does                                                                        |
|----------------|-----------------------------------------------------------------------------|
| engine thread  | runs queued commands (add, abort, admin reads) between steps, then a step;  |
|                | pushes each step's new tokens to the handles; finished requests leave the   |
|                | engine at once (a bounded ``history`` of them stays for the admin routes)   |
| event loop     | ``await service.submit(...)``, ``await gen.wait()`` / ``gen.updates()``,     |
|                | ``await service.run(fn)`` (fn runs on the engine thread, lock held)          |

So a route never holds a thread while a generation runs, and an admin read waits at most one
step. A disconnected or timed-out client's requests are aborted in the engine (``abort``).

Under the raise policy the requests that read damaged K/V fail (500 naming the violation's
reasons and launch points, never cached content; a stream ends with an error event) and the
engine goes on serving the rest (``OnViolation.FAIL_REQUESTS``, the default). With
``OnViolation.STOP``, or when the watchdog fires under raise or recompute, or on an unexpected
engine error, the engine stops stepping: every waiting generation fails with 503, later requests
too, ``/health`` answers 503, and the admin routes keep answering, so the incident can be
inspected. What a caller without the admin token sees of a failure or a stop names no token id,
chain, prompt or engine request id; the log has the full violation line. Shutdown drains: new
requests are refused (503), in-flight ones run for ``ServeLimits.drain_s``, then the rest are
aborted with a clean 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from prometheus_client import CollectorRegistry

from kvcanary.core.record import Reason
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.sampler import SamplingParams
from kvcanary.errors import CanaryViolation, KVCanaryError
from kvcanary.faults import FAULTS, Fault
from kvcanary.faults.hooks import attach_faults
from kvcanary.runtime.canary import Canary, Recovery, WatchdogTimeout
from kvcanary.runtime.metrics import CanaryCollector
from kvcanary.runtime.sweep import SweepRun
from kvcanary.server.admin import AdminTarget, CanaryAdmin
from kvcanary.server.config import OnViolation, ServeConfig, ServeLimits
from kvcanary.server.engine_metrics import EngineMetrics
from kvcanary.server.errors import ApiError
from kvcanary.server.tokenizer import TextOutput

__all__ = ["EngineService", "Generation", "OnViolation", "ServeConfig", "ServeLimits"]

log = logging.getLogger("kvcanary.server")
_KEEP_REPORTS = 256  # step reports with violations kept by the canary hooks (the admin log keeps more)


class Generation:
    """One prompt's generation as a route sees it. The engine thread appends ``tokens`` (checked,
    final tokens), sets ``finish_reason`` or ``error``, then sets ``changed`` (an ``asyncio.Event``
    shared by the generations of one request) on the route's event loop: at every new token when
    ``stream``, else only when it ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop, changed: asyncio.Event, client_id: str, prompt_len: int,
                 max_tokens: int, stream: bool = False, text: TextOutput | None = None):
        self.loop, self.changed, self.stream = loop, changed, stream
        self.client_id, self.prompt_len, self.max_tokens = client_id, prompt_len, max_tokens
        self.engine_id = -1
        self.tokens: list[int] = []
        self.text = text  # its text, cut at a stop string (None: the route decodes ``tokens`` itself)
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._behind = False  # the engine retracted outputs we delivered: compare when it catches up

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _notify(self) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.changed.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _finish(self, reason: str) -> None:
        self.finished_at = self.finished_at or time.monotonic()
        self.finish_reason = reason
        self._notify()

    def _fail(self, error: ApiError) -> None:
        if not self.is_done:
            self.finished_at = self.finished_at or time.monotonic()
            self.error = error
            self._notify()


class EngineService(AdminTarget):
    """Owns the engine, its canary and fault hooks, the engine thread and the admin state."""

    def __init__(self, config: ServeConfig):
        self.config = config
        engine, hooks, fault_hooks = attach_faults(lambda h: Engine(config.model, config.engine, h), config.canary,
                                                   ())
        self.engine, self.hooks, self.fault_hooks = engine, hooks, fault_hooks
        engine.delivery.keep_log = False  # a server runs for months: nothing may grow with the tokens served
        super().__init__(hooks.canary, threading.RLock())
        self.limits = config.limits
        self.metrics = EngineMetrics(engine)
        registry = CollectorRegistry()
        registry.register(CanaryCollector(self.canaries()))  # read on the event loop, see ``read``
        registry.register(self.metrics)
        self.admin = CanaryAdmin(self, config.admin, registry)
        self.error: str | None = None
        self.draining = False
        self.live: dict[int, Generation] = {}  # engine id -> handle, while it runs
        self.names: dict[int, str] = {}  # engine id -> client id, live and the last ``history`` finished
        self.history: deque[dict] = deque(maxlen=config.limits.history)
        self._retired: deque[int] = deque(maxlen=config.limits.history)
        for c in self.canaries():
            c.request_names = self.names
        self._reports_seen = 0
        self._next_id = 1
        self._commands: list[tuple[Callable, concurrent.futures.Future]] = []
        self._wake = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stop = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcanary-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_drain(self, seconds: float | None = None) -> None:
        """Refuse new requests from now; abort what still runs after ``seconds`` (default ``drain_s``)."""
        if self.draining:
            return
        self.draining = True
        seconds = self.limits.drain_s if seconds is None else seconds
        log.warning("kv_canary server: draining %d request(s) for at most %.1f s", len(self.live), seconds)
        timer = threading.Timer(seconds, self.abort_all, args=("the server is shutting down; the request was "
                                                               "aborted after the drain period",))
        timer.daemon = True
        timer.start()

    def abort_all(self, message: str) -> concurrent.futures.Future:
        def run():
            for gen in list(self.live.values()):
                self._abort(gen, ApiError(503, message))
        return self.call(run)

    def stop(self, timeout: float = 10.0) -> None:
        self.draining = True
        self.abort_all("the server is shutting down")
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the engine thread -------------------------------------------------------------------------

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps, ``lock`` held; returns its future
        (inline when the thread does not run)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self.is_running and not self._stop:
                self._commands.append((fn, fut))
                self._wake.notify_all()
                return fut
        with self.lock:
            self._run_command(fn, fut)
        return fut

    async def run(self, fn: Callable):
        return await asyncio.wrap_future(self.call(fn))

    async def read(self, fn: Callable):
        """Status and metrics read at once, on the event loop, while the engine steps: the engine
        thread only ever replaces or appends what they read (totals, counter snapshots, deques),
        so a read sees each value whole; it may see a step half accounted (one counter ahead)."""
        return fn()

    @staticmethod
    def _run_command(fn: Callable, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the awaiting route
            fut.set_exception(e)

    def _can_step(self) -> bool:
        """Work to do: requests to step, or (reports read one step late) tokens waiting for the
        report of the last step, which an idle engine reads with a flush."""
        return self.error is None and (self.engine.has_unfinished or self.engine.delivery.has_pending)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self._stop and not self._can_step():
                    self._wake.wait(0.5)
                commands, self._commands = self._commands, []
                if self._stop and not commands:
                    return
            with self.lock:
                for fn, fut in commands:
                    self._run_command(fn, fut)
                if self._can_step():
                    self._step()

    def _step(self) -> None:
        try:
            if self.engine.has_unfinished:
                result = self.engine.step()
                touched = dict.fromkeys((*result.request_ids, *result.finished_ids))
            else:  # idle with tokens held back: read the last reports (a recovery may re-queue requests)
                self.hooks.flush(self.engine.step_index, keep=True)
                touched = dict.fromkeys(self.live)
        except CanaryViolation as e:  # raised at the end of a completed step: its readers failed
            self.admin.log.add(e.violations, self.names)  # first: kept before clients hear
            if self.config.on_violation is OnViolation.STOP:
                self._stopped(f"a KV-cache violation ({violation_summary(e.violations)}) under the raise policy "
                              "with on_violation 'stop'")
                log.error("kv_canary server: engine stopped (on_violation stop): %s", e)
                return
            log.error("kv_canary server: request(s) %s failed under the raise policy: %s",
                      ", ".join(str(self.names.get(r, r)) for r in e.request_ids) or "none", e)
            for rid in e.request_ids:
                gen = self.live.get(rid)
                if gen is not None:
                    self._release(gen, "failed")
                    gen._fail(ApiError(500, failure_message(e.violations, rid)))
            touched = dict.fromkeys(self.live)
        except WatchdogTimeout as e:
            self._stopped("the canary's watchdog fired: its checks stopped running")
            log.error("kv_canary server: engine stopped: %s", e)
            return
        except Exception as e:  # the engine thread must not die silently
            self._stopped(f"an internal error ({type(e).__name__}); the server log has the details")
            log.exception("kv_canary server: engine stopped")
            return
        finally:
            self._feed_admin()
        if self.engine.delivery.lag:  # a step delivers what earlier steps sampled
            touched = dict.fromkeys(self.live)
        for rid in touched:
            gen = self.live.get(rid)
            if gen is not None:
                self._deliver(gen)

    def _stopped(self, error: str) -> None:
        self.error = error
        for gen in list(self.live.values()):
            gen._fail(ApiError(503, f"the engine stopped: {error}"))

    def _deliver(self, gen: Generation) -> None:
        req = self.engine.requests[gen.engine_id]
        # only delivered tokens go out: their step's report has been read (see engine.delivery)
        out, n = req.output_ids[: self.engine.delivery.count(gen.engine_id)], len(gen.tokens)
        if len(out) < n:
            gen._behind = True  # recompute retracted delivered tokens; they must come back the same
        elif len(out) > n:
            if gen._behind:
                gen._behind = False
                if out[:n] != gen.tokens:
                    self._abort(gen, ApiError(500, "the request was recomputed after a KV-cache violation and "
                                                   "its tokens changed after they were streamed; retry it"))
                    return
            if gen.first_token_at is None:
                gen.first_token_at = time.monotonic()
            new = out[n:]
            if gen.text is not None and gen.text.stops:  # a token at a time: the one that completes a stop ends it
                new = next((new[: i + 1] for i in range(len(new)) if gen.text.feed(new[i : i + 1])), new)
            elif gen.text is not None:
                gen.text.feed(new)
            gen.tokens.extend(new)
            self.metrics.generation_tokens.inc(len(new))
            if gen.text is not None and gen.text.is_stopped:
                if req.status is not RequestStatus.FINISHED:
                    self.engine.abort(gen.engine_id)  # nothing more of it is wanted
                self._release(gen, "finished", "stop")
                gen._finish("stop")
                return
            if gen.stream and req.status is not RequestStatus.FINISHED:
                gen._notify()
        if req.status is RequestStatus.FINISHED and not gen._behind and len(out) == len(req.output_ids):
            if gen.text is not None:
                gen.text.finish()
            self._release(gen, "finished")  # first: the engine has forgotten it before the client hears
            gen._finish("length")

    def _abort(self, gen: Generation, error: ApiError) -> None:
        if gen.engine_id in self.engine.requests:
            self.engine.abort(gen.engine_id)
        self._release(gen, "aborted")
        gen._fail(error)

    def _release(self, gen: Generation, status: str, reason: str = "length") -> None:
        rid = gen.engine_id
        if self.live.pop(rid, None) is None:
            return
        gen.finished_at = gen.finished_at or time.monotonic()
        self.engine.requests.pop(rid, None)
        self.engine.delivery.forget(rid)
        if len(self._retired) == self._retired.maxlen:
            self.names.pop(self._retired[0], None)
        self._retired.append(rid)
        self.metrics.finished(gen, status, reason)
        ttft = None if gen.first_token_at is None else round(gen.first_token_at - gen.created, 6)
        self.history.append({"request": rid, "client": gen.client_id, "status": status,
                             "prompt_tokens": gen.prompt_len, "completion_tokens": len(gen.tokens),
                             "ttft_s": ttft, "e2e_s": round((gen.finished_at or time.monotonic()) - gen.created, 6)})

    def _feed_admin(self) -> None:
        reports = self.hooks.reports
        for r in reports[self._reports_seen:]:
            self.admin.record(r)
        self._reports_seen = len(reports)
        if len(reports) > _KEEP_REPORTS:  # the admin log holds them now; the faults have read them too
            n = len(reports) - _KEEP_REPORTS
            del reports[:n]
            self._reports_seen -= n
            self.fault_hooks._num_reports = max(self.fault_hooks._num_reports - n, 0)

    # --- requests ----------------------------------------------------------------------------------

    async def submit(self, prompts: Sequence[Sequence[int]], max_tokens: int, client_ids: Sequence[str],
                     stream: bool = False, sampling: SamplingParams | None = None,
                     texts: Sequence[TextOutput] | None = None) -> list[Generation]:
        """Queue ``prompts`` (token ids) for ``max_tokens`` each, named ``client_ids[i]`` in
        violations and incidents; ``stream``: wake the route at every token; ``sampling``: how
        each picks its tokens (None: greedy); ``texts[i]``: prompt i's text output (its stop
        strings end it). Raises ApiError: 400 for a request the engine refuses, 429 when the
        queue is full, 503 when the engine stopped or the server drains."""
        loop, changed = asyncio.get_running_loop(), asyncio.Event()
        texts = list(texts) if texts is not None else [None] * len(prompts)
        gens = [Generation(loop, changed, cid, len(p), max_tokens, stream, text)
                for p, cid, text in zip(prompts, client_ids, texts, strict=True)]

        def add() -> None:
            if self.error is not None:
                raise ApiError(503, f"the engine stopped: {self.error}")
            if self.draining:
                raise ApiError(503, "the server is shutting down; retry on another replica")
            if len(self.live) + len(gens) > self.limits.max_queued:
                raise ApiError(429, f"the engine holds {len(self.live)} generations and takes at most "
                                    f"{self.limits.max_queued}; retry later")
            added = []
            try:
                for p, gen in zip(prompts, gens, strict=True):
                    gen.engine_id = self.engine.add_request(p, max_tokens, request_id=self._next_id,
                                                            sampling=sampling)
                    self._next_id += 1  # never reused: names and history stay unambiguous
                    added.append(gen)
                    self.live[gen.engine_id] = gen
                    self.names[gen.engine_id] = gen.client_id
            except (ValueError, KVCanaryError) as e:
                for g in added:
                    self._abort(g, ApiError(400, str(e)))
                param = "prompt" if len(prompts) == 1 else f"prompt[{len(added)}]"
                raise ApiError(400, f"{param}: {e}", "prompt") from None
            self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))

        await self.run(add)
        return gens

    def abort(self, gens: Sequence[Generation], error: ApiError) -> None:
        """Abort ``gens`` in the engine (fire and forget; safe from a cancelled task)."""
        pending = [g for g in gens if not g.is_done]
        if pending:
            self.call(lambda: [self._abort(g, error) for g in pending if g.engine_id in self.live])

    # --- AdminTarget ------------------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        return self.engine.step_index

    def canaries(self) -> list[Canary]:
        return [c for c in (self.hooks.canary, getattr(self.hooks, "window_canary", None)) if c is not None]

    def sweep_runs(self) -> list[SweepRun]:
        return [SweepRun(r.slots, r.token_ids, r.start_position, r.prev_slot)
                for r in self.engine.prefix_cache_slots()]

    def slot_owners(self, slot: int) -> list[dict]:
        owners = []
        for req in self.engine.scheduler.running:
            hits = torch.nonzero(req.slots[: req.num_cached] == slot).flatten().tolist()
            owners += [{"request": req.request_id, "client": self.names.get(req.request_id), "position": int(p)}
                       for p in hits]
        if self.engine.tree is not None:
            for node in self.engine.tree.nodes():
                if not node.is_on_host:
                    hits = torch.nonzero(node.slots == slot).flatten().tolist()
                    owners += [{"prefix_cache": True, "position": node.start + int(p), "locks": node.lock_count}
                               for p in hits]
        return owners

    def fault_kinds(self) -> list[str]:
        return list(FAULTS)

    def inject_fault(self, kind: str, params: dict) -> dict:
        """Arm ``FAULTS[kind](**params)`` after checking every parameter's name and type;
        ``warmup_steps`` counts from now (default 0: the next step)."""
        params = dict(params)
        check_fault_params(FAULTS[kind], params)
        warmup = params.pop("warmup_steps", 0)
        if warmup < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup!r}")
        fault = FAULTS[kind](warmup_steps=self.engine.step_index + warmup, **params)
        fault.attach(self.engine, self.canary)
        self.fault_hooks.faults.append(fault)
        log.warning("kv_canary server: fault %s armed from step %d (%s)", kind, self.engine.step_index + warmup,
                    params)
        return {"fault": kind, "armed_from_step": self.engine.step_index + warmup, "params": params}

    def injections(self) -> list[dict]:
        return [{"fault": i.fault, "step": i.step, "slot": i.slot, "detail": i.detail}
                for i in self.fault_hooks.injections]

    def recover(self, recovery: Recovery) -> None:
        self.engine.apply_recovery(recovery)

    def quarantine(self, violations: list) -> None:
        self.hooks.quarantine(violations)

    def engine_status(self, reveal: bool = True) -> dict:
        """The engine's state; without ``reveal`` the recent requests are counts and timings only
        (no engine or client request ids)."""
        e = self.engine
        recent = list(self.history)[-10:]
        if not reveal:
            recent = [{**r, "request": None, "client": None} for r in recent]
        return {"model": self.config.model_name, "step": e.step_index, "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting), "free_slots": e.pool.num_free_slots,
                "in_flight": len(self.live), "draining": self.draining, "stopped": self.error,
                "on_violation": self.config.on_violation.value, "known_requests": len(e.requests),
                "recent_requests": recent, "stats": e.stats.as_dict()}


def violation_summary(violations: Sequence, request_id: int | None = None) -> str:
    """``"fingerprint at TAIL; chain+position at HEAD"``: the reasons and launch points of
    ``violations`` (those ``request_id`` read, when given), never cached content."""
    if request_id is not None:
        violations = [v for v in violations if request_id in v.requests] or violations
    parts = dict.fromkeys(f"{'+'.join(Reason.names(v.reasons))} at {v.point.name}" for v in violations)
    return "; ".join(parts) or "no violation row"


def failure_message(violations: Sequence, request_id: int) -> str:
    """The error a request failed under the raise policy ends with."""
    return (f"the request read damaged KV-cache entries ({violation_summary(violations, request_id)}) and was "
            "failed under the raise policy; no output computed from the damage was sent; retry it")


_JSON_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),)}


def check_fault_params(cls: type[Fault], params: dict) -> None:
    """Raise ValueError unless every key of ``params`` is a keyword of ``cls`` (or of ``Fault``'s
    gate) and its value has the annotated type (bool is not an int; a name we do not know, such
    as an enum, takes a string)."""
    accepted: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                accepted[p.name] = str(p.annotation)
    for key, value in params.items():
        if key not in accepted:
            raise ValueError(f"unknown parameter {key!r}; {cls.name} takes {', '.join(sorted(accepted))}")
        names = [n.strip() for n in accepted[key].split("|")]
        types = tuple(t for n in names for t in _JSON_TYPES.get(n, (str,)))
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise ValueError(f"{key} must be {' or '.join(names)}, got {value!r}")
