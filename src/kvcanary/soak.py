"""The soak: the reference engine, clean, for a generated-token budget, with every mechanism the
canary guards exercised and counted.

``soak_workload(tokens)`` is the built-in workload (shared system prompts, long chunked prompts,
aborts) with just enough requests to generate ``tokens`` tokens; ``run_soak`` streams it through
an engine with the canary on, in O(1) host work per step whatever its length, and returns the
count of each mechanism (``MECHANISMS``). A soak passes when every count is above zero, the
canary reported no violation and its watchdog stayed quiet: a soak that never evicted, loaded
back or preempted proves nothing about those paths.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import Workload, WorkloadConfig, builtin_workload

# mechanism -> what is counted
MECHANISMS = {
    "prefix_hit_tokens": "tokens admitted from the prefix cache",
    "evicted_slots": "device slots released by prefix-cache eviction",
    "offloaded_slots": "of those, copied to the host tier",
    "loaded_slots": "host rows loaded back into device slots (offload round-trips)",
    "prefill_chunks": "prefill chunks that left the prompt unfinished (chunked prefill)",
    "aborts": "requests aborted while running",
    "preemptions": "running requests retracted for memory",
    "sweeps": "canary sweeps of idle prefix-cache slots",
}


def soak_workload(tokens: int, config: WorkloadConfig | None = None) -> Workload:
    """The built-in workload of ``config`` (default: ``WorkloadConfig()``) with the fewest requests
    that generate >= ``tokens`` tokens (an aborted request generates ``max_new_tokens // 2``)."""
    c = config or WorkloadConfig()
    m = c.max_new_tokens
    per_cycle = c.abort_every and (c.abort_every - 1) * m + m // 2  # tokens of abort_every requests
    num = max(-(-tokens * c.abort_every // per_cycle) if per_cycle else -(-tokens // m), 1)
    while True:
        workload = builtin_workload(dataclasses.replace(c, num_requests=num))
        if sum(r.abort_after or r.max_new_tokens for r in workload.requests) >= tokens:
            return workload
        num += 1


@dataclass
class SoakResult:
    requests: int = 0
    generated_tokens: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    mechanisms: dict[str, int] = field(default_factory=dict)
    violations: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    watchdog_alarms: int = 0
    protected_slots: int = 0  # slots stamped at HEAD
    verified_slots: int = 0  # slot checks at HEAD, TAIL and SWEEP

    @property
    def missing(self) -> list[str]:
        """Mechanisms the soak never exercised."""
        return [name for name, n in self.mechanisms.items() if n == 0]

    @property
    def passed(self) -> bool:
        return not self.missing and self.violations == 0 and self.watchdog_alarms == 0

    def to_json(self) -> dict:
        return {"passed": self.passed, "requests": self.requests, "generated_tokens": self.generated_tokens,
                "steps": self.steps, "wall_seconds": self.wall_seconds,
                "tokens_per_second": self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0,
                "mechanisms": dict(self.mechanisms), "missing_mechanisms": self.missing,
                "violations": self.violations, "by_reason": dict(self.by_reason),
                "watchdog_alarms": self.watchdog_alarms, "protected_slots": self.protected_slots,
                "verified_slots": self.verified_slots}


def run_soak(engine: Engine, hooks: CanaryHooks, workload: Workload,
             progress: Callable[[int], None] | None = None) -> SoakResult:
    """Drive ``engine`` (built with ``hooks``, attached) through ``workload`` like
    ``run_workload``: requests join one per step, the marked ones are aborted halfway.
    ``progress(generated tokens)`` is called after each step."""
    reqs, stats = workload.requests, engine.stats
    result, t0 = SoakResult(), time.perf_counter()
    to_abort: dict[int, int] = {}  # engine id -> tokens after which it is aborted
    num_added, tick = 0, 0
    while num_added < len(reqs) or engine.has_unfinished:
        if not engine.has_unfinished:  # idle: jump to the next arrival
            tick = max(tick, reqs[num_added].arrival_step)
        while num_added < len(reqs) and reqs[num_added].arrival_step <= tick:
            r = reqs[num_added]
            rid = engine.add_request(list(r.prompt_ids), r.max_new_tokens)
            if r.abort_after:
                to_abort[rid] = r.abort_after
            num_added += 1
        for rid, after in list(to_abort.items()):
            req = engine.requests[rid]
            if req.status is RequestStatus.RUNNING and len(req.output_ids) >= after:
                engine.abort(rid)
            if req.status in (RequestStatus.FINISHED, RequestStatus.ABORTED):
                del to_abort[rid]
        if engine.has_unfinished:
            step = engine.step()
            if step.batch is not None:
                ends = (step.batch.extend_lens > 1).tolist()
                result.mechanisms["prefill_chunks"] = result.mechanisms.get("prefill_chunks", 0) + sum(
                    is_prefill and rid not in step.new_tokens
                    for rid, is_prefill in zip(step.request_ids, ends, strict=False))
                result.generated_tokens += len(step.new_tokens)
        tick += 1
        if progress is not None:
            progress(result.generated_tokens)
    hooks.flush(engine.step_index)
    totals = hooks.canary.totals
    result.requests, result.steps = num_added, stats.num_steps
    result.generated_tokens = sum(len(engine.requests[r].output_ids) for r in engine.requests)
    result.wall_seconds = time.perf_counter() - t0
    result.mechanisms = {"prefix_hit_tokens": stats.num_prefix_hit_tokens, "evicted_slots": stats.num_evicted_slots,
                         "offloaded_slots": stats.num_offloaded_slots, "loaded_slots": stats.num_loaded_slots,
                         "prefill_chunks": result.mechanisms.get("prefill_chunks", 0), "aborts": stats.num_aborts,
                         "preemptions": stats.num_preemptions, "sweeps": totals.sweeps}
    counters = hooks.canary.counters()
    result.violations = max(counters["ring_total"], totals.violations)
    result.violations += (hooks.window_report() or {}).get("violations", 0)  # the sliding-window pool's
    result.protected_slots = counters["HEAD"]["stamped"]
    result.verified_slots = sum(counters[p]["checked"] for p in ("HEAD", "TAIL", "SWEEP"))
    result.by_reason = dict(sorted(totals.by_reason.items()))
    result.watchdog_alarms = totals.watchdog_alarms
    return result
