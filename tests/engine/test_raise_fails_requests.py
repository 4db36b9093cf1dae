"""The raise policy fails the requests that read damaged K/V, not the engine: the step that found
the damage completes for the others, ``CanaryViolation`` names the failed requests, the damaged
slot is quarantined, and the engine keeps stepping; the clean requests deliver exactly the tokens
of a fault-free run."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import CanaryViolation
from kvcanary.faults.base import flip_bit

from ._helpers import make_engine, random_prompts

PROMPTS = random_prompts(31, 3, min_len=20, max_len=30)
MAX_NEW = 12


CUDA = pytest.param("cuda", True, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


def _engine(policy: Policy = Policy.RAISE, device: str = "cpu"):
    return attach_canary(lambda h: make_engine(h, enable_prefix_cache=False, device=device),
                         CanaryConfig(policy=policy))


def _fault_free(device: str = "cpu") -> dict[int, list[int]]:
    engine, _ = _engine(Policy.LOG, device)
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    engine.run_until_done()
    return {i: engine.output_ids(i) for i in ids}


@pytest.mark.parametrize(("device", "late"), [("cpu", False), ("cpu", True), CUDA],
                         ids=["same-step", "a-step-late", "cuda"])
def test_a_flipped_slot_fails_exactly_its_reader_and_the_engine_goes_on(device, late, as_on_cuda):
    want = _fault_free(device)
    late = late or device == "cuda"
    if late and device == "cpu":  # reports read at the end of the next step, as on CUDA
        as_on_cuda()
    engine, hooks = _engine(device=device)
    assert engine.delivery.lag == int(late)
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    while min(len(engine.requests[i].output_ids) for i in ids) < 3:
        engine.step()
    victim = ids[1]
    slot = int(engine.requests[victim].slots[5])
    flip_bit(engine, 0, Half.K, slot, 0, 1)  # inside the fingerprinted first 16 bytes of layer 0 K
    step = engine.step_index
    if late:  # the damaged step runs clean-looking; its report comes with the next one
        engine.step()
        step += 1
    with pytest.raises(CanaryViolation) as info:
        engine.step()
    e = info.value
    assert e.request_ids == (victim,)
    assert {(v.slot, v.point, v.reasons) for v in e.violations} == {(slot, LaunchPoint.TAIL, Reason.FINGERPRINT)}
    assert f"failed requests: {victim};" in str(e)
    assert engine.step_index == step + 1  # the step completed for the others
    req = engine.requests[victim]
    assert req.status is RequestStatus.FAILED and not req.is_active
    assert engine.pool.num_quarantined_slots == engine.config.page_size
    assert engine.stats.num_quarantined_slots == hooks.canary.totals.quarantined_slots == engine.config.page_size
    engine.check_integrity()
    engine.run_until_done()  # usable: no further violation
    engine.check_integrity()
    for rid in ids:
        if rid != victim:
            assert engine.requests[rid].status is RequestStatus.FINISHED
            assert engine.output_ids(rid) == want[rid]
    # the failed request's outputs are those sampled before the damaged step, all of them fault-free
    assert engine.output_ids(victim) == want[victim][: len(engine.output_ids(victim))]
    assert engine.delivery.tokens()[victim] == engine.output_ids(victim)
    assert engine.abort(victim) is False


def test_log_policy_keeps_serving_the_reader():
    engine, hooks = _engine(Policy.LOG)
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    while min(len(engine.requests[i].output_ids) for i in ids) < 3:
        engine.step()
    flip_bit(engine, 0, Half.K, int(engine.requests[ids[0]].slots[5]), 0, 1)
    engine.run_until_done()
    assert all(engine.requests[i].status is RequestStatus.FINISHED for i in ids)
    assert sum(len(r.violations) for r in hooks.reports) >= 1


def hybrid_model():
    """A model whose layers 0 and 2 keep their K/V in a window pool, and an engine config for it."""
    from kvcanary.engine.config import EngineConfig, ModelConfig

    model = ModelConfig(num_layers=4, sliding_window=6, window_layers=(0, 2), seed=3)
    return model, EngineConfig(num_slots=384, max_rows=9, max_ctx=96, chunk_size=16, max_tokens_per_step=48,
                               max_running=4, window_slots=72, enable_prefix_cache=False)


def hybrid_raise_run(victim: int) -> tuple:
    """An engine of ``hybrid_model`` with a RAISE canary, run until every request has 3 outputs:
    (engine, hooks, request ids, the id of request ``victim``, the full-pool slot of the token
    before its last computed one, a 1-element tensor: a slot it reads at its next step)."""
    from kvcanary.engine.engine import Engine

    model, config = hybrid_model()
    engine, hooks = attach_canary(lambda h: Engine(model, config, h), CanaryConfig(policy=Policy.RAISE))
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    while min(len(engine.requests[i].output_ids) for i in ids) < 3:
        engine.step()
    req = engine.requests[ids[victim]]
    return engine, hooks, ids, ids[victim], req.slots[req.num_cached - 2 : req.num_cached - 1]


def test_damage_in_the_window_pool_fails_its_reader_and_both_pools_report():
    """A hybrid model: the window pool's canary is read in the same step as the full pool's, and
    its raise fails the reader as the full pool's does."""
    from kvcanary.core.record import PoolKind
    from kvcanary.engine.engine import Engine

    want = Engine(*hybrid_model()).generate(PROMPTS, MAX_NEW)
    engine, hooks, ids, victim, full = hybrid_raise_run(0)
    window_slot = int(engine.pool.window.translate(full)[0])
    assert window_slot > 0
    flip_bit(engine, 0, Half.K, window_slot, 0, 1)  # layer 0 keeps its K/V in the window pool
    with pytest.raises(CanaryViolation) as info:
        engine.step()
    assert info.value.request_ids == (victim,)
    assert {v.tag.pool for v in info.value.violations} == {PoolKind.SWA}
    assert hooks.canary.totals.steps == hooks.window_canary.totals.steps  # both pools read the step
    engine.run_until_done()
    engine.check_integrity()
    assert engine.requests[victim].status is RequestStatus.FAILED
    assert [engine.output_ids(i) for i in ids[1:]] == [want[i] for i in range(1, len(ids))]


def test_fail_and_recompute_skip_requests_a_server_already_dropped():
    """With reports a step late, ``delivery.holding`` remembers who read a slot; a server that
    dropped such a request (its client left) must not make ``fail``/``recompute`` look it up."""
    for act in ("fail", "recompute"):
        engine = make_engine(enable_prefix_cache=False)
        engine.delivery.lag = 1  # as on CUDA: a step's tokens wait for the next step's report
        ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
        for _ in range(4):
            engine.step()
        gone = ids[0]
        slot = int(engine.requests[gone].slots[1])
        engine.abort(gone)
        engine.requests.pop(gone)
        engine.delivery.forget(gone)
        if act == "fail":
            assert engine.fail([gone], [slot], since_step=engine.step_index - 1) == []
        else:
            assert gone not in engine.recompute([], [slot], since_step=engine.step_index - 1)
        engine.run_until_done()
        engine.check_integrity()


@pytest.mark.parametrize("pool", ["full", "window"])
def test_a_flush_raises_when_one_pool_alone_found_the_damage(pool, reports_a_step_late):
    """A hybrid model with reports a step late: the damaged step's report is still pending when the
    run flushes. Only the damaged pool's canary raises (the other reads a clean step), and that is
    enough: ``flush`` fails the reader and raises naming it, whichever pool found the damage."""
    from kvcanary.core.record import PoolKind

    reports_a_step_late()
    engine, hooks, ids, victim, full = hybrid_raise_run(1)
    assert engine.delivery.lag == 1
    # layer 0 keeps its K/V in the window pool (by window slot), layer 1 in the full pool
    layer, slot = (0, int(engine.pool.window.translate(full)[0])) if pool == "window" else (1, int(full[0]))
    assert slot > 0
    flip_bit(engine, layer, Half.K, slot, 0, 1)  # inside the fingerprinted first 16 bytes
    engine.step()  # the damaged step; its report is read at the end of the next, here the flush's
    assert all(engine.requests[i].status is not RequestStatus.FAILED for i in ids)
    with pytest.raises(CanaryViolation) as info:
        hooks.flush(engine.step_index)
    e = info.value
    assert e.request_ids == (victim,)
    want_pool = PoolKind.SWA if pool == "window" else PoolKind.FULL
    assert {(v.tag.pool, v.slot, v.point, v.reasons) for v in e.violations} == {
        (want_pool, slot, LaunchPoint.TAIL, Reason.FINGERPRINT)}
    assert engine.requests[victim].status is RequestStatus.FAILED
    engine.run_until_done()
    engine.check_integrity()
    assert all(engine.requests[i].status is RequestStatus.FINISHED for i in ids if i != victim)
