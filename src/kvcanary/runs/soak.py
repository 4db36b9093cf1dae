"""``kv-canary soak``: the reference engine, clean, for a generated-token budget, with every
mechanism the canary guards exercised and counted.

``soak_workload(tokens)`` is the built-in workload (shared system prompts, long chunked prompts,
aborts) with just enough requests to generate ``tokens`` tokens; ``run_soak`` streams it through
an engine with the canary on (``runs.driver``, O(1) host work per step whatever its length) and
returns the count of each mechanism (``MECHANISMS``). A soak passes when every count is above
zero, the canary reported no violation and its watchdog stayed quiet: a soak that never evicted,
loaded back or preempted proves nothing about those paths.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine, StepResult
from kvcanary.engine.workload import Workload, WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.runs.driver import Driver, RunCounts
from kvcanary.runs.report import CanaryCounts
from kvcanary.runs.setup import SoakOptions, canary_config, check_device, model_config
from kvcanary.runs.single import canaries, instrument

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
SOAK_WORKLOAD = WorkloadConfig(num_system_prompts=8, block_size=2)  # many prompts leave and come back


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
class SoakReport:
    """What a soak ran (``counts``), how often each mechanism ran, what the canary reported."""

    counts: RunCounts
    wall_seconds: float
    mechanisms: dict[str, int]
    canary: CanaryCounts
    engine: dict[str, int] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the engine's: device, num_slots, host_tier_slots

    @property
    def missing(self) -> list[str]:
        """Mechanisms the soak never exercised."""
        return [name for name, n in self.mechanisms.items() if n == 0]

    @property
    def passed(self) -> bool:
        return not self.missing and self.canary.violations == 0 and self.canary.watchdog_alarms == 0

    def to_json(self) -> dict:
        c = self.canary
        n = self.counts
        return {"passed": self.passed, "requests": n.requests, "generated_tokens": n.generated_tokens,
                "steps": n.steps, "wall_seconds": self.wall_seconds,
                "tokens_per_second": n.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0,
                "mechanisms": dict(self.mechanisms), "missing_mechanisms": self.missing,
                "violations": c.violations, "by_reason": dict(sorted(c.by_reason.items())),
                "watchdog_alarms": c.watchdog_alarms, "protected_slots": c.protected_slots,
                "verified_slots": c.verified_slots, "engine": self.engine}


class _Mechanisms:
    """Per tick: generated tokens (for the progress bar) and prefill chunks that left a prompt unfinished."""

    def __init__(self, progress: Callable[[int], None] | None):
        self.progress, self.generated_tokens, self.prefill_chunks = progress, 0, 0

    def __call__(self, step: StepResult | None) -> None:
        if step is not None and step.batch is not None:
            is_prefill = (step.batch.extend_lens > 1).tolist()
            self.prefill_chunks += sum(p and rid not in step.new_tokens
                                       for rid, p in zip(step.request_ids, is_prefill, strict=False))
            self.generated_tokens += len(step.new_tokens)
        if self.progress is not None:
            self.progress(self.generated_tokens)


def run_soak(engine: Engine, hooks: CanaryHooks, workload: Workload,
             progress: Callable[[int], None] | None = None) -> SoakReport:
    """Drive ``engine`` (built with ``hooks``, attached) through ``workload``; ``progress(generated
    tokens)`` is called after each tick."""
    t0, seen = time.perf_counter(), _Mechanisms(progress)
    counts = Driver(engine, workload).run(on_tick=seen)
    final = hooks.flush(engine.step_index)
    stats = engine.stats
    violations = [v for r in hooks.reports for v in r.violations] + final.violations
    alarms = [a for r in hooks.reports for a in r.alarms] + final.alarms
    canary = CanaryCounts.of(canaries(hooks), violations, alarms)
    mechanisms = {"prefix_hit_tokens": stats.num_prefix_hit_tokens, "evicted_slots": stats.num_evicted_slots,
                  "offloaded_slots": stats.num_offloaded_slots, "loaded_slots": stats.num_loaded_slots,
                  "prefill_chunks": seen.prefill_chunks, "aborts": stats.num_aborts,
                  "preemptions": stats.num_preemptions, "sweeps": canary.sweeps}
    return SoakReport(counts, time.perf_counter() - t0, mechanisms, canary, stats.as_dict())


def soak(options: SoakOptions, progress: Callable[[int], None] | None = None) -> SoakReport:
    """``kv-canary soak``: the soak workload of ``options`` through a fresh engine with the canary."""
    device = check_device(options.device)
    model = model_config(options.model, options.seed)
    workload = soak_workload(options.tokens, dataclasses.replace(SOAK_WORKLOAD, seed=options.seed,
                                                                 vocab_size=model.vocab_size))
    engine_config = engine_config_for(workload, device)
    built = instrument(lambda h: Engine(model, engine_config, h), CanaryHooks(canary_config(options.canary)))
    result = run_soak(built.engine, built.hooks, workload, progress)
    result.config = {"device": engine_config.device, "num_slots": engine_config.num_slots,
                     "host_tier_slots": engine_config.host_tier_slots}
    return result
