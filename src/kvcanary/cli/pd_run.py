"""``kv-canary run --pd``: the built-in workload through a prefill/decode split of two reference
engines in one process; the report of ``run`` with per-side counts and the transfer's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import typer

from kvcanary.core.record import LaunchPoint
from kvcanary.engine.workload import Progress
from kvcanary.faults.base import Fault
from kvcanary.faults.campaign import RunSetup
from kvcanary.faults.pd_campaign import PDOutcome, Side, run_pd_once

ENGINE_SUMS = ("num_evicted_slots", "num_offloaded_slots", "num_loaded_slots", "num_aborts", "num_preemptions",
               "num_recomputes")


def side_report(side: Side, steps: int, seconds: float) -> dict:
    """One engine's part of the report: its canary's counters and violations, its engine's stats."""
    canary = side.hooks.canary
    totals, counters = canary.totals, canary.counters()
    return {"steps": steps, "step_seconds": seconds,
            "violations": max(counters["ring_total"], len(side.violations)),
            "by_reason": dict(sorted(totals.by_reason.items())),
            "by_launch_point": {p.name: totals.by_launch_point.get(p.name, 0) for p in LaunchPoint},
            "protected_slots": counters["HEAD"]["stamped"],
            "verified_slots": sum(counters[p.name]["checked"] for p in LaunchPoint),
            "sweeps": totals.sweeps, "canary_seconds": totals.seconds, "watchdog_alarms": len(side.alarms),
            "engine": side.engine.stats.as_dict(),
            "first_violations": [v.to_json() for v in side.violations[:20]]}


def build_pd_report(setup: RunSetup, out: PDOutcome) -> dict:
    """The report of ``run`` (summed over both engines) plus ``prefill``, ``decode`` and ``transfer``."""
    c = out.counts
    prefill = side_report(out.prefill, c.prefill_steps, c.prefill_seconds)
    decode = side_report(out.decode, c.decode_steps, c.decode_seconds)
    sides = (prefill, decode)
    total = lambda key: sum(s[key] for s in sides)
    step_seconds = c.prefill_seconds + c.decode_seconds
    by_reason: dict[str, int] = {}
    for s in sides:
        for k, v in s["by_reason"].items():
            by_reason[k] = by_reason.get(k, 0) + v
    return {
        "requests": c.requests, "finished": c.finished, "aborted": c.aborted, "prompt_tokens": c.prompt_tokens,
        "generated_tokens": c.generated_tokens, "steps": c.prefill_steps + c.decode_steps,
        "step_seconds": step_seconds, "violations": total("violations"), "by_reason": dict(sorted(by_reason.items())),
        "by_launch_point": {p.name: sum(s["by_launch_point"][p.name] for s in sides) for p in LaunchPoint},
        "canary_time_share": total("canary_seconds") / step_seconds if step_seconds > 0 else 0.0,
        "canary_seconds": total("canary_seconds"), "wall_seconds": out.wall_seconds,
        "protected_slots": total("protected_slots"), "verified_slots": total("verified_slots"),
        "sweeps": total("sweeps"), "watchdog_alarms": total("watchdog_alarms"), "stopped": out.error,
        "engine": {k: sum(s["engine"][k] for s in sides) for k in ENGINE_SUMS},
        "prefill": prefill, "decode": decode, "transfer": dataclasses.asdict(out.transfer.stats),
        "injections": [{"fault": i.fault, "step": i.step, "slot": i.slot, "detail": i.detail}
                       for i in out.injections],
        "config": {"pd": True, "policy": setup.canary.policy.value, "real_kv": setup.canary.real_kv.name.lower(),
                   "sweep_interval": setup.canary.sweep_interval, "device": setup.engine.device},
    }


def run_pd(setup: RunSetup, faults: Sequence[Fault], progress: Progress | None = None) -> dict:
    """``kv-canary run --pd``: run the split and build its report. Faults act on the decode
    engine and (transfer faults) on the transfer."""
    if setup.model.window_layers:
        raise typer.BadParameter("--pd moves full-attention pools only; use --model tiny or small", param_hint="--pd")
    if not setup.engine.enable_prefix_cache:
        raise typer.BadParameter("--pd needs the prefix cache: the decode engine receives K/V through it")
    return build_pd_report(setup, run_pd_once(setup, faults, progress))
