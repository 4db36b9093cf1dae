"""The run package: the command line takes its defaults from the frozen options, the options
refuse what cannot run, the driver's counts, the report's merges across pools, sides and ranks."""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter

import pytest
import typer

from kvcanary.cli import app
from kvcanary.config import Policy
from kvcanary.errors import CanaryViolation
from kvcanary.faults import TransferByteFlip, UsedSlotFlip
from kvcanary.runs.pd import report as pd_report
from kvcanary.runs.pd import run_pd_once
from kvcanary.runs.report import CanaryCounts, RankSection, RunReport, merge_ranks
from kvcanary.runs.setup import (
    CanaryOptions,
    DemoOptions,
    EngineKind,
    OptionError,
    RunOptions,
    SoakOptions,
    canary_config,
    run_setup,
)
from kvcanary.runs.single import report, run_once


def small_setup(num_requests: int, policy: Policy = Policy.LOG):
    return run_setup(RunOptions(requests=num_requests, canary=CanaryOptions(policy=policy, sweep_interval=4)))


def _defaults(command: str) -> dict:
    click_cmd = typer.main.get_command(app).commands[command]
    return {p.name: p.default for p in click_cmd.params}


def _flat(options) -> dict:
    out = {}
    for f in dataclasses.fields(options):
        v = getattr(options, f.name)
        out |= _flat(v) if dataclasses.is_dataclass(v) else {f.name: v}
    return out


@pytest.mark.parametrize("command, options", [("run", RunOptions()), ("soak", SoakOptions()),
                                              ("demo", DemoOptions().run)])
def test_the_command_line_defaults_are_the_options(command, options):
    cli, want = _defaults(command), _flat(options)
    shared = {"requests", "max_new_tokens", "seed", "model", "device", "policy", "sweep_interval", "sweep_budget",
              "stats_period", "fault_warmup", "engine", "tp", "pd", "tokens"} & cli.keys() & want.keys()
    assert shared, cli
    for name in shared:  # the command line names a choice by its value (it imports no enum before parsing)
        assert _value(cli[name]) == _value(want[name]), name
    assert cli["real_kv"] == want["real_kv"].name.lower()


def _value(v):
    return v.value if isinstance(v, enum.Enum) else v


def test_options_refuse_two_modes_at_once():
    with pytest.raises(OptionError, match="--tp and --pd cannot be combined"):
        RunOptions(tp=2, pd=True)
    with pytest.raises(OptionError, match="--engine transformers and --pd"):
        RunOptions(engine=EngineKind.TRANSFORMERS, pd=True)


def test_a_stopped_run_counts_what_ran_until_it_stopped():
    setup = small_setup(num_requests=12, policy=Policy.RAISE)
    out = run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=6)])
    assert out.error and out.violations
    assert 0 < out.counts.steps == out.engine.stats.num_steps
    assert out.counts.requests == len(out.engine.requests) and out.counts.finished < out.counts.requests
    assert out.counts.generated_tokens == sum(len(r.output_ids) for r in out.engine.requests.values())
    rep = report(setup, out).to_json()
    assert rep["stopped"] == out.error and rep["violations"] >= 1


def test_run_once_raises_what_it_is_not_told_to_stop_at():
    setup = small_setup(num_requests=12, policy=Policy.RAISE)
    with pytest.raises(CanaryViolation):
        run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=6)], stopping=())


def _counts(**kw) -> CanaryCounts:
    return dataclasses.replace(CanaryCounts(), **kw)


def test_merge_sums_sides_and_takes_the_largest_seconds_over_ranks():
    a = _counts(violations=2, by_reason=Counter(chain=2), protected_slots=5, seconds=1.0, device={"ring_total": 2})
    b = _counts(violations=1, by_reason=Counter(chain=1, position=1), protected_slots=7, seconds=3.0,
                device={"ring_total": 1})
    sides = CanaryCounts.merge([a, b])
    assert (sides.violations, sides.protected_slots, sides.seconds) == (3, 12, 4.0)
    assert sides.by_reason == Counter(chain=3, position=1) and sides.device == {"ring_total": 3}
    ranks = CanaryCounts.merge([a, b], parallel=True)
    assert (ranks.violations, ranks.seconds) == (3, 3.0)


def test_the_pools_of_one_engine_count_their_shared_breakdown_once():
    setup = small_setup(num_requests=6)
    out = run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=4)])
    full = out.hooks.canary
    one = CanaryCounts.of([full], out.violations, out.alarms)
    twice = CanaryCounts.of([full, full], out.violations, out.alarms)  # as two pools sharing one breakdown
    assert one.by_reason and twice.by_reason == one.by_reason and twice.sweeps == one.sweeps
    assert twice.protected_slots == 2 * one.protected_slots


def test_merged_ranks_keep_rank_0s_counts_and_tag_violations_with_their_rank():
    setup = small_setup(num_requests=6)
    rep = report(setup, run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=4)]))
    ranks = [dataclasses.replace(rep, rank=RankSection(r, 2, [], [])) for r in range(2)]
    merged = merge_ranks(ranks)
    data = merged.to_json()
    assert data["world"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["violations"] == 2 * rep.canary.violations and data["requests"] == rep.counts.requests
    assert {v["rank"] for v in data["first_violations"]} == {0, 1} and isinstance(merged, RunReport)


def test_merged_ranks_carry_the_incidents_of_every_rank():
    setup = small_setup(num_requests=6)
    rep = report(setup, run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=4)]))
    assert rep.incidents["incidents"] >= 1
    data = merge_ranks([dataclasses.replace(rep, rank=RankSection(r, 2, [], [])) for r in range(2)]).to_json()
    for key in ("incidents", "incidents_open", "redetections"):
        assert data[key] == 2 * rep.incidents[key], key
    assert data["incidents_by_reason"] == {k: 2 * n for k, n in rep.incidents["incidents_by_reason"].items()}
    n = len(rep.incidents["first_incidents"])
    assert Counter(i["rank"] for i in data["first_incidents"]) == Counter({0: n, 1: n})
    assert [r["incidents"] for r in data["ranks"]] == [rep.incidents["incidents"]] * 2


@pytest.mark.parametrize("faulty", [True, False], ids=["transfer_byte_flip", "clean"])
def test_a_split_run_report_carries_incidents_on_both_sides_and_merged(faulty):
    setup = small_setup(num_requests=16)
    fault = TransferByteFlip(seed=1, warmup_steps=4)
    out = run_pd_once(setup, [fault] if faulty else [])
    data = pd_report(setup, out).to_json()
    sides = data["prefill"]["incidents"], data["decode"]["incidents"]
    assert data["incidents"] == sum(sides)
    if not faulty:
        assert data["incidents"] == 0 and data["first_incidents"] == [] and data["violations"] == 0
        return
    (inj,) = fault.injections
    assert sides == (0, data["incidents"]) and data["incidents"] >= 1  # the decode side reads the damage
    first = data["first_incidents"][0]
    assert (first["side"], first["slot"], first["reasons"]) == ("decode", inj.slot, ["fingerprint"])
    assert first["first_violation"]["sources"] and first["layer"] == first["first_violation"]["layer"]


def test_canary_options_build_the_config():
    c = canary_config(CanaryOptions(policy=Policy.RECOMPUTE, sweep_interval=3, sweep_budget=4096, truth=False))
    assert (c.policy, c.sweep_interval, c.sweep_budget_bytes, c.truth) == (Policy.RECOMPUTE, 3, 4096, False)
    with pytest.raises(OptionError, match="sweep_interval"):
        canary_config(CanaryOptions(sweep_interval=-1))
