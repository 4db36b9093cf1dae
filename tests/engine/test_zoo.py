"""The real-bug zoo: each switch is triggered by its workload and detected at its expected launch
point with its expected reasons (the first violation the bug explains), without false positives;
its twin (same workload and engine features, switch off) reports nothing. Plus the engine
features the triggers need (speculative drafts, batch padding), checked correct on their own."""

from __future__ import annotations

import pytest

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine import Engine, EngineConfig, ModelConfig, SamplerKind
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import CATALOGUE, Bug
from kvcanary.errors import ConfigError
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.campaign import ZOO_STOPPING, run_zoo_case, twin, zoo_cases
from kvcanary.runs.single import run_once

from ._helpers import engine_config, random_prompts

CANARY = CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode.PARTIAL, sweep_interval=4)  # the demo's
CASES = {c.bug: c for c in zoo_cases(ModelConfig(), CANARY, WorkloadConfig(num_requests=32))}

# what the canary reports first on each case: reasons @ launch point, and the steps from the bug's
# first act to that report (fingerprint-only damage waits for a reader; sweeps run every 4 steps)
FIRST_DETECTION = {
    Bug.ABORT_INFLIGHT_WRITE: ("fingerprint @ TAIL", 0),
    Bug.PREFIX_PAGE_OFF_BY_ONE: ("read_conflict @ HEAD", 1),
    Bug.PADDING_WRITES_LIVE_SLOT: ("fingerprint @ TAIL", 15),
    Bug.OFFLOAD_SHARED_HOST_ROW: ("chain+position @ SWEEP", 8),
    Bug.LOAD_BACK_UNORDERED: ("fingerprint @ SWEEP", 15),
    Bug.STALE_RADIX_NODE: ("chain+position+verify_token @ SWEEP", 3),
    Bug.FAILED_LOAD_COUNTED: ("chain+position+verify_token @ HEAD", 0),
    Bug.REPREFILL_PROMPT_ONLY: ("chain+position+verify_token @ HEAD", 0),
    Bug.REJECTED_DRAFT_KV_CACHED: ("verify_token @ SWEEP", 4),
    Bug.PARTIAL_PAGE_HIT: ("verify_token @ HEAD", 0),
    Bug.CHUNK_POSITIONS_RESTART: ("write_position @ HEAD", 0),
}


def test_every_bug_has_a_case_an_expectation_and_a_public_link():
    assert set(CASES) == set(FIRST_DETECTION) == set(CATALOGUE) == set(Bug) and len(Bug) >= 10
    for bug, info in CATALOGUE.items():
        assert info.links and all(link.startswith("https://github.com/") for link in info.links), bug
        assert info.title and info.where and info.mechanism


@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_bug_is_detected_at_its_launch_point(bug):
    verdict, out = run_zoo_case(CASES[bug])
    assert out.engine.zoo.events and all(e.bug is bug for e in out.engine.zoo.events)
    assert verdict.injected and verdict.detected, verdict
    assert (verdict.first_detection, verdict.steps_to_detection) == FIRST_DETECTION[bug]
    assert verdict.false_positives == 0 and out.error is None


@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_as_on_cuda_the_verdict_is_the_same(bug, as_on_cuda):
    """As on CUDA, where each step's rows are read at the end of the next and decode batches hand
    their token truth as appends: every row keeps its own step and its owners (a writer whose
    request left in between is still named) and the truth table holds what whole histories
    would have written, so the verdict is the one of a report read at once."""
    as_on_cuda()
    verdict, out = run_zoo_case(CASES[bug])
    assert out.hooks.canary.reporter.lag == 1 and out.engine.config.appends_truth
    assert verdict.injected and verdict.detected, verdict
    assert (verdict.first_detection, verdict.steps_to_detection) == FIRST_DETECTION[bug]
    assert verdict.false_positives == 0 and out.error is None


@pytest.mark.parametrize("cuda_like", [False, True], ids=["cpu", "as_on_cuda"])
@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_twin_without_the_switch_is_clean(bug, cuda_like, as_on_cuda):
    if cuda_like:
        as_on_cuda()
    out = run_once(twin(CASES[bug]), stopping=ZOO_STOPPING)
    assert out.error is None and out.violations == [] and not out.alarms
    assert out.engine.zoo.events == [] and out.counts.finished + out.counts.aborted == 32
    out.engine.check_integrity()


def test_switches_are_off_by_default_and_validated():
    assert EngineConfig().bugs == frozenset()
    assert EngineConfig(bugs=["stale_radix_node"]).bugs == frozenset({Bug.STALE_RADIX_NODE})
    with pytest.raises(ConfigError, match=r"EngineConfig.bugs must be a set of kvcanary.engine.zoo.Bug"):
        EngineConfig(bugs={"no_such_bug"})
    with pytest.raises(ConfigError, match="EngineConfig.bugs"):
        EngineConfig(bugs="stale_radix_node")
    with pytest.raises(ConfigError, match="num_draft_tokens must be 0 with the greedy sampler"):
        EngineConfig(num_draft_tokens=2)
    with pytest.raises(ConfigError, match="graph_batch_sizes"):
        EngineConfig(graph_batch_sizes=(4, 2))


def test_host_invariants_catch_the_page_table_off_by_one():
    """The bookkeeping side of a zoo bug: the page table no longer matches the slot record."""
    engine = Engine(ModelConfig(), engine_config(page_size=4, bugs={Bug.PREFIX_PAGE_OFF_BY_ONE}))
    shared = list(range(1, 5))
    engine.generate([shared + list(range(10, 22))], 2)
    engine.add_request(shared + list(range(30, 40)), 2)
    engine.step()
    assert [e.bug for e in engine.zoo.events] == [Bug.PREFIX_PAGE_OFF_BY_ONE]
    with pytest.raises(AssertionError, match="req_to_token row .* != its slot record"):
        engine.check_integrity()


def _clean_run(prompts, max_new_tokens, **overrides):
    engine, hooks = attach_canary(lambda h: Engine(ModelConfig(), engine_config(**overrides), h),
                                  CanaryConfig(real_kv=FingerprintMode.ALL, sweep_interval=1))
    ids = [engine.add_request(p, max_new_tokens) for p in prompts]
    batch_sizes = []
    while engine.has_unfinished:
        batch_sizes.append(engine.step().batch.batch_size)
        engine.check_integrity()
    hooks.canary.flush(engine.step_index)
    assert hooks.canary.totals.violations == 0 and not hooks.reports
    return [engine.output_ids(i) for i in ids], engine, batch_sizes


def test_speculative_drafts_keep_the_oracle_outputs_and_free_rejected_slots():
    prompts = random_prompts(3, 6, prefix_len=9)
    plain, plain_engine, _ = _clean_run(prompts, 12, sampler=SamplerKind.ORACLE)
    drafted, engine, _ = _clean_run(prompts, 12, sampler=SamplerKind.ORACLE, num_draft_tokens=3)
    assert drafted == plain and all(len(o) == 12 for o in drafted)
    assert engine.stats.num_steps < plain_engine.stats.num_steps  # accepted drafts save decode steps
    assert engine.pool.num_free_slots + sum(n.slots.numel() for n in engine.tree.nodes()) == \
        engine.config.num_usable_slots  # no slot of a rejected draft leaked


def test_padding_to_graph_batch_sizes_changes_nothing():
    prompts = random_prompts(4, 5, max_len=20)
    plain, *_ = _clean_run(prompts, 6)
    padded, engine, batch_sizes = _clean_run(prompts, 6, graph_batch_sizes=(1, 2, 4, 8))
    assert padded == plain and 8 in batch_sizes  # 5 decodes padded to 8 (float64 is batch-invariant)
    assert not engine.zoo.events

