"""The reference engine's hooks build a sweep's runs the step before it, after a replayed forward's
launch (``Canary.prefetch_sweep`` from ``CanaryHooks.after_forward``), and only then. On the CPU
no forward replays: these runs take every forward for a replay, which on the CPU changes nothing
else, and compare each with the same run left as it is: the same tokens emitted at every step,
the same violations, fewer runs converted by the sweeps. On CUDA, with graph-captured decode."""

from __future__ import annotations

import pytest
import torch

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.faults.judge import judge, select_faults
from kvcanary.runs.single import run_once
from kvcanary.runtime import sweep as sweep_module
from kvcanary.runtime.canary import Canary

from ._helpers import small_setup


def _run(monkeypatch, replaying: bool, faults=(), **setup):
    """One run of the built-in workload; with ``replaying``, every forward taken for a replay.
    Returns (outcome, (step, entries) of each step whose end built a sweep's runs, the runs the
    sweeps converted)."""
    prefetched, converted, inside = [], [0], [False]
    convert = sweep_module._entries

    def counted(runs, *a):
        converted[0] += 0 if inside[0] else len(runs)  # by the sweeps only
        return convert(runs, *a)
    monkeypatch.setattr(sweep_module, "_entries", counted)
    prefetch = Canary.prefetch_sweep

    def prefetching(self, runs):
        inside[0] = True
        try:
            prefetched.append((self.totals.steps - 1, prefetch(self, runs)))  # the step whose end ran
        finally:
            inside[0] = False
        return prefetched[-1][1]
    monkeypatch.setattr(Canary, "prefetch_sweep", prefetching)
    if replaying:
        before = CanaryHooks.before_forward

        def replayed(self, batch):
            self.engine.replaying = True  # as the engine sets it before a graph replay
            before(self, batch)
        monkeypatch.setattr(CanaryHooks, "before_forward", replayed)
    out = run_once(small_setup(**setup), faults)
    monkeypatch.undo()
    return out, prefetched, converted[0]


def _emitted(out) -> list:
    return [(d.step, d.request_id, d.index, d.token) for d in out.engine.delivery.log]


def _found(out) -> list:
    return [(v.step, v.slot, v.point.name, int(v.reasons)) for v in out.violations]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_step_before_each_sweep_builds_its_runs_and_changes_no_token_and_no_verdict(seed, monkeypatch):
    plain, none, plain_converted = _run(monkeypatch, False, seed=seed)
    replayed, prefetched, converted = _run(monkeypatch, True, seed=seed)
    assert none == [] and plain.violations == [] and replayed.violations == [] and plain.error is None
    steps = replayed.engine.stats.num_steps
    every = replayed.hooks.canary.config.sweep_interval
    assert [s for s, _ in prefetched] == [s for s in range(steps) if (s + 1) % every == 0]
    assert any(n for _, n in prefetched) and converted < plain_converted
    assert _emitted(replayed) == _emitted(plain) and len(_emitted(plain)) == plain.counts.generated_tokens


@pytest.mark.parametrize("name", ["cached_slot_flip", "page_table_repoint"])
def test_a_fault_is_found_where_and_when_it_was_without_the_prefetch(name, monkeypatch):
    found = {}
    for replaying in (False, True):
        (fault,) = select_faults([name], seed=3, warmup_steps=12)
        out, prefetched, _ = _run(monkeypatch, replaying, [fault])
        verdict = judge(fault, out.injections, out.violations)
        assert verdict.injected and verdict.detected and verdict.false_positives == 0
        assert bool(prefetched) is replaying
        found[replaying] = (_found(out), _emitted(out))
    assert found[True] == found[False] and found[True][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replayed_steps_build_the_next_sweeps_runs(monkeypatch):
    """On CUDA with graph-captured decode: a sweep's runs are built after a replay the step before
    it, and the run's tokens and verdicts equal those of eager decode (which builds none ahead)."""
    eager, none, _ = _run(monkeypatch, False, engine={"device": "cuda", "truth_appends": False})
    graphed, prefetched, _ = _run(monkeypatch, False, engine={"device": "cuda", "cuda_graph": True,
                                                                 "graph_batch_sizes": (1, 2, 4, 8, 16)})
    assert none == [] and graphed.engine.graphs.replays > 0 and prefetched
    every = graphed.hooks.canary.config.sweep_interval
    assert all((s + 1) % every == 0 for s, _ in prefetched)
    assert eager.violations == [] and graphed.violations == []
    assert {r: q.output_ids for r, q in graphed.engine.requests.items()} == {
        r: q.output_ids for r, q in eager.engine.requests.items()}
