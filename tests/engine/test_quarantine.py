"""Quarantine: under every policy a slot found damaged leaves the prefix cache (and the host tier)
at its first detection and is never served to another request. Later requests with the same
prefix miss from the damaged page on and recompute it (their tokens equal a fault-free run's);
a running request still reading the damage keeps it until it ends (log) or is recovered
(recompute, raise); the incident closes when its last holder frees the slot (raise and recompute
retire it: never handed out again; log returns it to the free list); metrics and the run report
count the quarantined slots."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import CanaryViolation
from kvcanary.faults import CachedSlotFlip, attach_faults
from kvcanary.faults.base import flip_bit
from kvcanary.runs.report import CanaryCounts
from kvcanary.runtime.metrics import CanaryCollector

from ._helpers import engine_config, random_prompts

POLICIES = [Policy.LOG, Policy.RAISE, Policy.RECOMPUTE]
PREFIX, OTHER = random_prompts(41, 2, min_len=30, max_len=30)
MAX_NEW = 6


def _scraped_quarantined(canary) -> float:
    registry = CollectorRegistry()
    registry.register(CanaryCollector([canary]))
    text = generate_latest(registry).decode()
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "kvcanary_quarantined_slots_total")


def _build(policy: Policy, page_size: int, faults=(), host_tier_slots: int = 0):
    config = engine_config(page_size=page_size, host_tier_slots=host_tier_slots)
    return attach_faults(lambda h: Engine(ModelConfig(seed=5), config, h),
                         CanaryConfig(policy=policy, sweep_interval=1), list(faults))


def _step_all(engine) -> int:
    """Step until done; returns how many steps raised ``CanaryViolation`` (raise policy)."""
    raised = 0
    while engine.has_unfinished:
        try:
            engine.step()
        except CanaryViolation:
            raised += 1
        engine.check_integrity()
    return raised


def _scenario(policy: Policy, page_size: int, faulty: bool):
    """A's prompt is cached; while an unrelated request runs, a bit of an idle cached slot of A
    flips right before a sweep (``CachedSlotFlip``); then two requests with A's prompt arrive
    together. Returns (engine, canary hooks, fault, ids, hit lengths of the two, positions of
    cached slots before the flip, steps that raised)."""
    fault = CachedSlotFlip(seed=7, probability=1.0, max_injections=1 if faulty else 0, warmup_steps=10**9)
    engine, hooks, _ = _build(policy, page_size, [fault])
    a = engine.add_request(PREFIX, MAX_NEW)
    assert _step_all(engine) == 0
    positions = {int(s): n.start + i for n in engine.tree.nodes() for i, s in enumerate(n.slots.tolist())}
    if faulty:
        fault.warmup_steps = engine.step_index  # it acts at the next step (each step sweeps)
    b = engine.add_request(OTHER, MAX_NEW)
    raised = 0
    try:
        engine.step()  # the flip and its sweep: detected (SWEEP) and quarantined in this step, whatever the policy
    except CanaryViolation:
        raised += 1
    ids = [a, b, engine.add_request(PREFIX, MAX_NEW), engine.add_request(PREFIX, MAX_NEW)]
    engine.step()  # both admitted here
    hits = [engine.requests[i].num_prefix_cached for i in ids[2:]]
    raised += _step_all(engine)
    return engine, hooks, fault, ids, hits, positions, raised


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
def test_a_damaged_cached_slot_is_never_served_again(policy, page_size):
    clean, clean_hooks, _, ids, clean_hits, _, clean_raised = _scenario(policy, page_size, faulty=False)
    engine, hooks, fault, ids2, hits, positions, raised = _scenario(policy, page_size, faulty=True)
    assert ids == ids2
    limit = (len(PREFIX) - 1) // page_size * page_size  # a hit leaves at least one token to compute
    # the fault-free twin: hits as usual, nothing found, nothing quarantined
    assert clean_hits == [limit, limit] and clean_raised == 0
    assert clean_hooks.canary.totals.violations == 0 and clean_hooks.canary.incidents.num_incidents == 0
    assert clean.stats.num_quarantined_slots == clean_hooks.canary.totals.quarantined_slots == 0
    assert _scraped_quarantined(clean_hooks.canary) == 0

    (inj,) = fault.injections
    slot, position = inj.slot, positions[inj.slot]
    t = hooks.canary.totals
    # detected once, by the sweep of the step it happened in, for a fingerprint mismatch
    assert t.violations == 1 and dict(t.by_label) == {("fingerprint", "SWEEP", "FULL"): 1}
    (incident,) = hooks.canary.incidents.history
    assert (incident.slot, incident.point, incident.reasons) == (slot, LaunchPoint.SWEEP, Reason.FINGERPRINT)
    assert incident.first.step == inj.step and incident.detections == 1
    # no reader held it: it was freed (retired) at once, after its step's report, so in the next
    # step's record: the incident is closed, by the free
    assert not incident.is_open and incident.closed_by == "freed" and incident.closed_step == inj.step + 1
    assert raised == (1 if policy is Policy.RAISE else 0)  # raise names no failed request: none read it
    # the two later requests miss from the damaged page on (the pages before it still hit)
    cut = min(position // page_size * page_size, limit)
    assert hits == [cut, cut]
    assert engine.stats.num_quarantined_slots == t.quarantined_slots == page_size
    assert _scraped_quarantined(hooks.canary) == page_size
    counts = CanaryCounts.of([hooks.canary], [], [])
    assert counts.quarantined_slots == page_size and counts.to_json()["quarantined_slots"] == page_size
    # raise and recompute retire the page for good; log, which keeps serving, returned it when freed
    assert engine.pool.num_quarantined_slots == (0 if policy is Policy.LOG else page_size)
    # every token equals the fault-free run's
    for rid in ids:
        assert engine.requests[rid].status is RequestStatus.FINISHED
        assert engine.output_ids(rid) == clean.output_ids(rid)
    assert engine.delivery.tokens() == clean.delivery.tokens()


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
def test_a_damaged_prefix_a_request_reads_leaves_the_cache_and_is_freed_when_it_ends(policy):
    """The damaged slot is in a cached prefix a running request reads: it leaves the index at
    once (later requests miss there) but is not taken from its reader; under log the reader goes
    on (and re-detects it), under recompute it re-prefills, under raise it fails. The slot is
    freed when the last holder lets go, and the incident closes then."""
    page_size = 4
    clean, _, _ = _build(Policy.LOG, page_size)
    engine, hooks, _ = _build(policy, page_size)
    for e in (clean, engine):
        e.add_request(PREFIX, MAX_NEW)
        assert _step_all(e) == 0
        e.add_request(PREFIX + [1, 2, 3], 2 * MAX_NEW)  # the reader: hits the cached prefix
        e.step()
        e.step()
    reader = engine.requests[1]
    assert reader.num_prefix_cached == 28 and reader.status is RequestStatus.RUNNING
    position = 13
    slot = int(reader.slots[position])
    flip_bit(engine, 0, Half.K, slot, 0, 1)
    try:
        engine.step()  # TAIL reads it: detected
        raised = 0
    except CanaryViolation as e:
        raised = 1
        assert e.request_ids == (1,)
    (incident,) = hooks.canary.incidents.history
    assert (incident.slot, incident.point, incident.reasons) == (slot, LaunchPoint.TAIL, Reason.FINGERPRINT)
    later = [engine.add_request(PREFIX, MAX_NEW), engine.add_request(PREFIX, MAX_NEW)]
    clean_later = [clean.add_request(PREFIX, MAX_NEW), clean.add_request(PREFIX, MAX_NEW)]
    assert later == clean_later
    if policy is Policy.LOG:  # the reader keeps its slots: the damaged page stays its until it ends
        assert reader.status is RequestStatus.RUNNING and int(reader.slots[position]) == slot
        assert engine.pool.is_quarantined(slot) and incident.is_open
    engine.step()
    clean.step()
    assert [engine.requests[i].num_prefix_cached for i in later] == [12, 12]  # the page of position 13 on missed
    assert [clean.requests[i].num_prefix_cached for i in later] == [28, 28]
    raised += _step_all(engine)
    _step_all(clean)
    assert raised == (1 if policy is Policy.RAISE else 0)
    hooks.flush(engine.step_index)  # (under log the reader freed it in the last step: its close is read now)
    assert not incident.is_open and incident.closed_by == "freed"
    assert hooks.canary.incidents.num_incidents == 1
    if policy is Policy.LOG:
        assert incident.detections > 1  # the reader read it at every step until it ended
    assert engine.stats.num_quarantined_slots == hooks.canary.totals.quarantined_slots == page_size
    assert engine.pool.num_quarantined_slots == (0 if policy is Policy.LOG else page_size)
    assert not engine.tree.detached
    assert all(slot not in run.slots.tolist() for run in engine.prefix_cache_slots())
    for rid in [0, *later]:
        assert engine.output_ids(rid) == clean.output_ids(rid)
    if policy is Policy.RECOMPUTE:
        assert engine.output_ids(1) == clean.output_ids(1)
    elif policy is Policy.RAISE:
        assert engine.requests[1].status is RequestStatus.FAILED
    # a request after all that hits the recomputed, clean prefix again
    again = engine.add_request(PREFIX, MAX_NEW)
    engine.step()
    assert engine.requests[again].num_prefix_cached == 28


def test_damage_loaded_back_from_the_host_tier_is_dropped():
    """A host row flips while its node is offloaded: the load-back verifies it (SWEEP) and the
    node leaves the cache; the request that loaded it goes on under log, a later one misses."""
    page_size = 2
    clean, _, _ = _build(Policy.LOG, page_size, host_tier_slots=64)
    engine, hooks, _ = _build(Policy.LOG, page_size, host_tier_slots=64)
    for e in (clean, engine):
        e.add_request(PREFIX, MAX_NEW)
        _step_all(e)
        e.cache.evict(e.config.num_slots)  # everything idle goes to the host tier
        assert all(n.is_on_host for n in e.tree.nodes())
    node = next(iter(engine.tree.root.children.values()))
    row = int(node.host_rows[9])
    engine.pool.host_k[0, row].view(-1).view(torch.uint8)[0] ^= 2  # layer 0 K, fingerprinted bytes
    for e in (clean, engine):
        e.add_request(PREFIX, MAX_NEW)  # loads the prefix back
        e.step()
    (incident,) = hooks.canary.incidents.history
    assert (incident.point, incident.reasons) == (LaunchPoint.SWEEP, Reason.FINGERPRINT)
    assert engine.requests[1].num_prefix_cached == 28  # it had loaded it before the check (log: it goes on)
    # the load took 28 rows back; the 6 rows cached after them left the host tier with the damage
    assert clean.host_tier.num_free_rows == 64 - 6 and engine.host_tier.num_free_rows == 64
    later = engine.add_request(PREFIX, MAX_NEW)
    clean_later = clean.add_request(PREFIX, MAX_NEW)
    engine.step()
    clean.step()
    assert engine.requests[later].num_prefix_cached == 8  # position 9's page on missed
    assert clean.requests[clean_later].num_prefix_cached == 28
    _step_all(engine)
    _step_all(clean)
    hooks.flush(engine.step_index)
    assert not incident.is_open and incident.closed_by == "freed"
    assert engine.stats.num_quarantined_slots == hooks.canary.totals.quarantined_slots == page_size
    for rid in (0, later):
        assert engine.output_ids(rid) == clean.output_ids(rid)


def test_damage_found_after_its_node_was_offloaded_is_dropped_from_the_host_tier():
    """A report naming slots whose node went to the host tier since (reports a step late) drops
    the host node from the damaged page on, its rows freed; a later request misses there."""
    page_size = 4
    engine, hooks, _ = _build(Policy.LOG, page_size, host_tier_slots=64)
    engine.add_request(PREFIX, MAX_NEW)
    _step_all(engine)
    node = next(iter(engine.tree.root.children.values()))
    slots = node.slots.clone()
    engine.cache.evict(engine.config.num_slots)
    assert node.is_on_host and engine.host_tier.num_free_rows == 64 - len(node.key)
    num_rows = len(node.key)
    assert engine.quarantine(slots[17:18]) == page_size  # free since: its page leaves the free list
    # the node was cut at position 16: its first 16 rows stay, the rest left the host tier
    (upper,) = engine.tree.root.children.values()
    assert upper.is_on_host and len(upper.key) == 16 and engine.host_tier.num_free_rows == 64 - 16
    assert engine.stats.num_dropped_host_slots == num_rows - 16
    engine.check_integrity()
    later = engine.add_request(PREFIX, MAX_NEW)
    engine.step()
    assert engine.requests[later].num_prefix_cached == 16
    _step_all(engine)


def test_quarantine_refuses_slots_outside_the_pool_and_bad_counts():
    engine, hooks, _ = _build(Policy.LOG, 1)
    with pytest.raises(ValueError, match=r"bad_slots must lie in \[0, 1024\)"):
        engine.quarantine([3, 1024])
    assert engine.stats.num_quarantined_slots == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=f"num_slots must be an int >= 0, got {bad!r}"):
            hooks.canary.slots_quarantined(bad)
    assert hooks.canary.totals.quarantined_slots == 0


def test_attach_canary_engine_counts_quarantine_once_per_page():
    """Re-detections of one quarantined page (a reader under log) count it once."""
    engine, hooks = attach_canary(lambda h: Engine(ModelConfig(seed=5), engine_config(page_size=4), h),
                                  CanaryConfig(policy=Policy.LOG))
    rid = engine.add_request(PREFIX, 3 * MAX_NEW)
    for _ in range(3):
        engine.step()
    flip_bit(engine, 0, Half.K, int(engine.requests[rid].slots[5]), 0, 1)
    _step_all(engine)
    t = hooks.canary.totals
    assert t.violations > 1 and hooks.canary.incidents.num_incidents == 1  # read at every step after
    assert t.quarantined_slots == engine.stats.num_quarantined_slots == 4
    # its own damaged page was never cached: the next request with that prompt misses there
    again = engine.add_request(PREFIX, MAX_NEW)
    engine.step()
    assert engine.requests[again].num_prefix_cached == 4
