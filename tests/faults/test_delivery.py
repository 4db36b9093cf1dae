"""The recompute guarantee, token by token: no token sampled from a forward that read or wrote
damaged K/V is ever delivered.

Every token the engine delivers (``Engine.delivery.log``: what a client would have been streamed)
is compared with the fault-free run's token at the same index, for every injector, every zoo bug
and the new reasons, with reports read in the step (CPU) and one step late (as on CUDA, simulated
here by a reporter lag of 1). A delivered token that a later recovery dropped counts as
``retracted``, and must stay 0: the recovery starts at the first damaged forward, never later.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import Bug
from kvcanary.faults import FAULTS
from kvcanary.faults.zoo_tracker import ZooTracker
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.campaign import twin, zoo_cases

from ._helpers import drive, small_setup

GREEDY = {"sampler": SamplerKind.GREEDY}  # outputs depend on every K/V the model reads


@dataclasses.dataclass
class Delivered:
    tokens: dict[int, list[int]]
    retracted: int
    recovered: int  # requests recomputed + slots quarantined
    complete: bool
    engine: Engine


def run_delivered(setup, faults=(), lag: int = 0, max_ticks: int = 3000, replayed: bool = False) -> Delivered:
    """Drive the workload with the canary and ``faults``; reports read ``lag`` steps late;
    ``replayed``: every forward taken for a graph replay (as on CUDA, where a replayed step
    delivers right after ``after_forward`` and builds the next sweep's runs there). A run that
    stops early (a bug acting again on every re-prefill) is judged on what it delivered."""
    run = drive(setup, faults, lag, replayed, max_ticks)
    engine = run.engine
    recovered = engine.stats.num_recomputes + engine.stats.num_quarantined_slots
    return Delivered(engine.delivery.tokens(), engine.delivery.retracted, recovered, run.complete, engine)


def assert_delivered_clean(got: Delivered, want: Delivered) -> None:
    """Every delivered token equals the fault-free run's at its index; none was taken back."""
    assert want.retracted == 0 and want.complete
    bad = {rid: (toks, want.tokens.get(rid, [])[: len(toks)]) for rid, toks in got.tokens.items()
           if toks != want.tokens.get(rid, [])[: len(toks)]}
    assert not bad, f"{len(bad)} requests delivered other tokens than the fault-free run: {next(iter(bad.items()))}"
    assert got.retracted == 0


def recompute_setup(**canary):
    return small_setup(policy=Policy.RECOMPUTE, engine=GREEDY, **canary)


@pytest.fixture(scope="module")
def fault_free():
    return run_delivered(recompute_setup())


@pytest.mark.parametrize("lag", [0, 1], ids=["in_step", "one_step_late"])
@pytest.mark.parametrize("name", list(FAULTS))
def test_no_token_from_a_damaged_forward_is_delivered(name, lag, fault_free):
    fault = FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.3, seed=3, warmup_steps=8,
                         max_injections=3)
    got = run_delivered(recompute_setup(), [fault], lag)
    assert fault.injections, f"{name} never acted"
    assert got.recovered > 0, f"{name}: nothing was recovered"  # the test can fail: damage was found
    assert got.complete
    assert_delivered_clean(got, fault_free)
    assert got.tokens == fault_free.tokens  # and every request still delivers all its tokens
    got.engine.check_integrity()


@pytest.mark.parametrize("name", list(FAULTS))
def test_replayed_steps_deliver_early_and_still_nothing_damaged(name, fault_free):
    """Reports a step late, every forward taken for a replay: each step delivers right after
    ``after_forward``. Nothing from a damaged forward goes out, every request delivers all its
    tokens, and a clean run delivers each token at the step it does when each step delivers after
    its sampling."""
    fault = FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.3, seed=3, warmup_steps=8,
                         max_injections=3)
    got = run_delivered(recompute_setup(), [fault], 1, replayed=True)
    assert fault.injections and got.recovered > 0 and got.complete
    assert_delivered_clean(got, fault_free)
    assert got.tokens == fault_free.tokens
    got.engine.check_integrity()


def test_a_replayed_step_delivers_early_what_it_delivered_late():
    late = run_delivered(recompute_setup(), lag=1)
    early = run_delivered(recompute_setup(), lag=1, replayed=True)
    # (step, request, index, token): the order of the requests within a step is not kept
    log = lambda d: sorted(tuple(x) for x in d.engine.delivery.log)  # noqa: E731
    assert late.complete and early.complete and log(early) == log(late) and len(log(late)) > 0
    assert early.tokens == late.tokens
    assert {d.step for d in early.engine.delivery.log} != {0} and early.retracted == late.retracted == 0


@pytest.mark.parametrize("early", [True, False])
def test_a_replayed_step_delivers_before_it_samples(early, monkeypatch):
    """With ``early_delivery`` (the default) a replayed step's deliveries are logged before its
    sampling runs; without it, after."""
    from kvcanary.engine.sampler import Sampler

    engines, seen = [], []
    sample = Sampler.sample

    def spy(self, *a, **k):
        log = engines[0].delivery.log
        seen.append(bool(log) and log[-1].step == engines[0].step_index)  # delivered in this step already
        return sample(self, *a, **k)
    monkeypatch.setattr(Sampler, "sample", spy)
    init = Engine.__init__

    def kept(self, *a, **k):
        init(self, *a, **k)
        self.early_delivery = early
        engines.append(self)
    monkeypatch.setattr(Engine, "__init__", kept)
    got = run_delivered(recompute_setup(), lag=1, replayed=True)
    assert got.complete and len(seen) == got.engine.stats.num_steps
    assert any(seen) is early


def test_without_recompute_the_damage_reaches_the_client(fault_free):
    """The twin under the log policy: the same faults deliver other tokens (so the comparison
    above can fail)."""
    faults = [FAULTS[n](probability=0.3, seed=3, warmup_steps=8, max_injections=3)
              for n in ("page_table_bad_entry", "write_target_duplicate", "used_slot_flip")]
    got = run_delivered(small_setup(policy=Policy.LOG, engine=GREEDY), faults)
    assert all(f.injections for f in faults)
    assert got.tokens != fault_free.tokens


@pytest.mark.parametrize("name", ["dropped_kv_write", "wrong_layer_write"])
def test_without_recompute_a_write_that_did_not_happen_reaches_the_client(name, fault_free):
    """Writes that did not happen change what later forwards read: under the log policy the
    client gets other tokens (so the recompute comparison above can fail for these faults)."""
    fault = FAULTS[name](probability=0.3, seed=3, warmup_steps=8, max_injections=3)
    got = run_delivered(small_setup(policy=Policy.LOG, engine=GREEDY), [fault])
    assert fault.injections
    assert got.tokens != fault_free.tokens


ZOO_CANARY = CanaryConfig(policy=Policy.RECOMPUTE, real_kv=FingerprintMode.PARTIAL, sweep_interval=4)
ZOO_CASES = {c.bug: c for c in zoo_cases(ModelConfig(), ZOO_CANARY, WorkloadConfig(num_requests=32))}


@pytest.mark.parametrize("lag", [0, 1], ids=["in_step", "one_step_late"])
@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_no_token_from_a_zoo_bug_is_delivered(bug, lag):
    """Each real-bug switch under recompute against its twin (switch off). Some bugs act again on
    every re-prefill, so the run may not finish within its bound; what it delivered must be clean."""
    case = ZOO_CASES[bug]
    want = run_delivered(twin(case), lag=lag)
    tracker = ZooTracker(bug)
    got = run_delivered(case.setup, [tracker], lag, max_ticks=4 * want.engine.step_index + 200)
    assert got.engine.zoo.events, f"{bug.value} never acted"
    assert got.recovered > 0
    assert_delivered_clean(got, want)
