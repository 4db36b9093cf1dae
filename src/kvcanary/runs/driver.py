"""The one driver loop of every run: a workload through an engine, or through a prefill/decode
pair (``KVTransfer``).

Per tick: requests join when their ``arrival_step`` has come (jumping ahead when the engines are
idle); on a split, the prefill engine steps and each finished prefill is transferred and joins
the decode engine (prompt + first token); marked requests are aborted once they produced
``abort_after`` tokens; the engine that generates (the decode engine on a split) steps once.
Exceptions of a step (a ``CanaryViolation`` under the raise policy) propagate; ``Driver.counts``
still tells what ran until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcanary.engine.engine import Engine, StepResult
from kvcanary.engine.pd import KVTransfer
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import Workload
from kvcanary.errors import CanaryViolation

Progress = Callable[[int, int], None]  # (requests done, requests in all), after each tick
OnTick = Callable[[StepResult | None], None]  # after each tick: the generating engine's step, if it ran one


@dataclass
class StepCounts:
    """Forwards one engine ran and the wall seconds spent inside its ``step``."""

    steps: int = 0
    seconds: float = 0.0

    def add(self, result: StepResult, seconds: float) -> None:
        self.steps += result.step_index >= 0
        self.seconds += seconds


@dataclass
class RunCounts:
    """What a run did to its workload. ``request_ids``: the generating engine's id of each
    workload request, in order (-1: never reached it). ``prefill``: the prefill engine's steps on
    a split (None otherwise); ``steps``/``step_seconds`` count every engine."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    request_ids: list[int] = field(default_factory=list)
    decode: StepCounts = field(default_factory=StepCounts)
    prefill: StepCounts | None = None

    @property
    def steps(self) -> int:
        return self.decode.steps + (self.prefill.steps if self.prefill else 0)

    @property
    def step_seconds(self) -> float:
        return self.decode.seconds + (self.prefill.seconds if self.prefill else 0.0)

    def to_json(self) -> dict:
        return {"requests": self.requests, "finished": self.finished, "aborted": self.aborted,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "steps": self.steps, "step_seconds": self.step_seconds}


class Driver:
    """Drives ``workload`` through ``target``: an ``Engine``, or a ``KVTransfer`` whose prefill
    engine takes the arrivals and whose decode engine generates."""

    def __init__(self, target: Engine | KVTransfer, workload: Workload):
        self.transfer = target if isinstance(target, KVTransfer) else None
        self.engine = self.transfer.decode if self.transfer else target  # the engine that generates
        self.workload = workload
        n = workload.num_requests
        self._ids = [-1] * n
        self._num_added = self._num_done = self._num_aborted = 0
        self._first_tokens = 0  # tokens sampled on the prefill engine
        self._finished_early = 0  # requests done with their first token (nothing to decode)
        self._to_abort: dict[int, int] = {}  # generating engine's id -> tokens after which it is aborted
        self._pending: dict[int, int] = {}  # prefill engine's id -> workload index
        self._prefill_tokens: dict[int, int] = {}  # prefill engine's id -> its first token
        self._ours: set[int] = set()  # ids of the workload's requests on the generating engine
        self._decode, self._prefill = StepCounts(), StepCounts() if self.transfer else None

    @property
    def _engines(self) -> list[Engine]:
        return [self.transfer.prefill, self.engine] if self.transfer else [self.engine]

    def run(self, progress: Progress | None = None, on_tick: OnTick | None = None) -> RunCounts:
        reqs, tick = self.workload.requests, 0
        while self._num_added < len(reqs) or any(e.has_unfinished for e in self._engines):
            if not any(e.has_unfinished for e in self._engines):  # idle: jump to the next arrival
                tick = max(tick, reqs[self._num_added].arrival_step)
            while self._num_added < len(reqs) and reqs[self._num_added].arrival_step <= tick:
                self._arrive(self._num_added)
                self._num_added += 1
            if self.transfer is not None and self.transfer.prefill.has_unfinished:
                self._prefill_step()
            self._abort_due()
            result = None
            if self.engine.has_unfinished:
                result = _timed_step(self.engine, self._decode)
                self._num_done += sum(rid in self._ours for rid in result.finished_ids)
            tick += 1
            if on_tick is not None:
                on_tick(result)
            if progress is not None:
                progress(self._num_done, len(reqs))
        return self.counts()

    def _arrive(self, i: int) -> None:
        r = self.workload.requests[i]
        if self.transfer is None:
            self._join(i, self.engine.add_request(list(r.prompt_ids), r.max_new_tokens))
        else:
            self._pending[self.transfer.prefill.add_request(list(r.prompt_ids), 1)] = i

    def _join(self, i: int, rid: int) -> None:
        self._ids[i] = rid
        self._ours.add(rid)
        after = self.workload.requests[i].abort_after
        if after:
            self._to_abort[rid] = after

    def _prefill_step(self) -> None:
        """One prefill step; each finished prompt is transferred and its request joins the decode engine."""
        result = _timed_step(self.transfer.prefill, self._prefill)
        self._prefill_tokens |= result.new_tokens
        for pid in result.finished_ids:
            i = self._pending.pop(pid)
            r = self.workload.requests[i]
            payload = self.transfer.send(pid, r.prompt_ids)
            if payload is not None:
                self.transfer.receive(payload)
            first = self._prefill_tokens.pop(pid)
            self._first_tokens += 1
            if r.max_new_tokens < 2:  # done with its first token: nothing to decode
                self._finished_early += 1
                self._num_done += 1
                continue
            self._join(i, self.engine.add_request([*r.prompt_ids, first], r.max_new_tokens - 1))

    def _abort_due(self) -> None:
        for rid, after in list(self._to_abort.items()):
            req = self.engine.requests[rid]
            if req.status is RequestStatus.RUNNING and len(req.output_ids) >= after:
                if self.engine.abort(rid):
                    self._num_aborted += 1
                    self._num_done += 1
                del self._to_abort[rid]
            elif req.status is RequestStatus.FINISHED:
                del self._to_abort[rid]

    def counts(self) -> RunCounts:
        """The counts so far (all of them once ``run`` returned)."""
        reqs = self.workload.requests[:self._num_added]
        ids = [i for i in self._ids if i >= 0]
        out = [self.engine.requests[i] for i in ids]
        return RunCounts(
            requests=len(reqs),
            finished=sum(r.status is RequestStatus.FINISHED for r in out) + self._finished_early,
            aborted=self._num_aborted, prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
            generated_tokens=self._first_tokens + sum(len(r.output_ids) for r in out),
            request_ids=list(self._ids) if self.transfer else ids, decode=self._decode, prefill=self._prefill)


def run_workload(target: Engine | KVTransfer, workload: Workload, progress: Progress | None = None,
                 on_tick: OnTick | None = None) -> RunCounts:
    """Drive ``workload`` through ``target`` (see ``Driver``) and return its counts."""
    return Driver(target, workload).run(progress, on_tick)


def _timed_step(engine: Engine, counts: StepCounts) -> StepResult:
    """``engine.step()``, counted and timed in ``counts``. The reference engine's canary hooks
    raise a ``CanaryViolation`` (raise policy) once its step is done: that step counts too."""
    t0, step = time.perf_counter(), engine.step_index
    try:
        result = engine.step()
    except CanaryViolation:
        counts.add(StepResult(step if engine.step_index > step else -1), time.perf_counter() - t0)
        raise
    counts.add(result, time.perf_counter() - t0)
    return result
