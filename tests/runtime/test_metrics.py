"""Prometheus metrics of the canary: names, labels and values equal the canary's totals, with a
fault (the labelled violation counter rises at its reason and launch point) and clean."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.faults import UsedSlotFlip, attach_faults
from kvcanary.runtime.metrics import CanaryCollector

NAMES = {"kvcanary_violations", "kvcanary_incidents", "kvcanary_violation_rows_dropped", "kvcanary_verified_slots",
         "kvcanary_stamped_slots", "kvcanary_sweeps", "kvcanary_verify_skipped", "kvcanary_recomputed_requests",
         "kvcanary_quarantined_slots", "kvcanary_watchdog_alarms", "kvcanary_steps", "kvcanary_seconds"}


def _run(faults):
    engine, hooks, _ = attach_faults(lambda h: Engine(ModelConfig(seed=3), EngineConfig(num_slots=256), h),
                                     CanaryConfig(sweep_interval=2), faults)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 14, 21)]
    engine.generate(prompts, 8)
    engine.generate([prompts[0] + [5, 6]], 4)  # a prefix-cache hit
    return hooks.canary


@pytest.fixture(scope="module")
def faulty():
    return _run([UsedSlotFlip(seed=1, warmup_steps=3)])


@pytest.fixture(scope="module")
def clean():
    return _run([])


def _scrape(registry) -> dict:
    """{(name, labels tuple): value} of every sample the registry exposes."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_violation_counter_rises_at_the_fault_reason_and_launch_point(faulty):
    registry = CollectorRegistry()
    registry.register(CanaryCollector([faulty]))
    key = ("kvcanary_violations_total", (("launch_point", "TAIL"), ("pool", "FULL"), ("reason", "fingerprint")))
    samples = _scrape(registry)
    assert samples[key] == faulty.totals.by_label["fingerprint", "TAIL", "FULL"] >= 1
    labelled = {(d["reason"], d["launch_point"], d["pool"]): v for d, v in
                ((dict(k[1]), v) for k, v in samples.items() if k[0] == key[0])}
    assert len(labelled) == len(Reason) * len(LaunchPoint)
    assert labelled == {k: float(faulty.totals.by_label.get(k, 0)) for k in labelled}
    # the flipped slot is read again later (TAIL) or swept once cached (SWEEP): fingerprint only
    assert {k for k, v in labelled.items() if v} <= {("fingerprint", "TAIL", "FULL"), ("fingerprint", "SWEEP", "FULL")}


def test_every_metric_equals_the_canary_totals(faulty):
    registry = CollectorRegistry()
    registry.register(CanaryCollector([faulty]))
    s, c, t = _scrape(registry), faulty.counters(), faulty.totals
    assert {name.removesuffix("_total") for name, _ in s if name.endswith("_total")} == NAMES
    assert s["kvcanary_verified_slots_total", ()] == sum(c[p.name]["checked"] for p in LaunchPoint) > 0
    assert s["kvcanary_stamped_slots_total", ()] == c["HEAD"]["stamped"] > 0
    assert s["kvcanary_sweeps_total", ()] == t.sweeps > 0
    assert s["kvcanary_steps_total", ()] == t.steps > 0
    assert s["kvcanary_seconds_total", ()] == pytest.approx(t.seconds)
    # the one flipped slot (page size 1) left the cache at its first detection, under log too
    assert s["kvcanary_quarantined_slots_total", ()] == t.quarantined_slots == 1
    for name in ("verify_skipped", "recomputed_requests", "watchdog_alarms", "violation_rows_dropped"):
        assert s[f"kvcanary_{name}_total", ()] == 0


def test_clean_run_exposes_zero_violations(clean):
    registry = CollectorRegistry()
    registry.register(CanaryCollector([clean]))
    s = _scrape(registry)
    violations = [v for (name, _), v in s.items() if name == "kvcanary_violations_total"]
    assert len(violations) == len(Reason) * len(LaunchPoint) and set(violations) == {0.0}
    assert s["kvcanary_quarantined_slots_total", ()] == 0
    assert s["kvcanary_verified_slots_total", ()] > 0


def test_two_canaries_sum_and_the_lock_is_held_while_reading(faulty, clean):
    class CountingLock:
        def __init__(self):
            self.inner, self.entered = threading.Lock(), 0

        def __enter__(self):
            self.inner.acquire()
            self.entered += 1

        def __exit__(self, *exc):
            self.inner.release()

    lock = CountingLock()
    registry = CollectorRegistry()
    registry.register(CanaryCollector([faulty, clean], lock=lock))
    s = _scrape(registry)
    assert lock.entered >= 1
    both = faulty.counters()["HEAD"]["stamped"] + clean.counters()["HEAD"]["stamped"]
    assert s["kvcanary_stamped_slots_total", ()] == both


def test_bad_canaries_argument_names_it():
    with pytest.raises(TypeError, match="canaries must be a non-empty sequence of Canary"):
        CanaryCollector([])
    with pytest.raises(TypeError, match="canaries must be a non-empty sequence of Canary"):
        CanaryCollector(["not a canary"])
