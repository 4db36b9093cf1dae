"""``Canary.prefetch_sweep``: the runs' entries built ahead of a sweep, so that the sweep converts
only what changed since; the sweep's plan and verdicts stay exactly those of a sweep without it.
On the CPU through the ops one by one and through the interpreted Triton kernels, and on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Reason
from kvcanary.errors import KVCanaryError
from kvcanary.runtime import sweep as sweep_module
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.runtime.sweep import SweepRun

from ._helpers import PATHS, prefilled, read_all

NUM_SLOTS, CTX = 300, 64


def _runs(slots, tokens, keep: int) -> list[SweepRun]:
    return [SweepRun(torch.tensor(s[keep:], dtype=torch.int64), tuple(t[keep:]), keep, s[keep - 1])
            for s, t in zip(slots, tokens, strict=True)]


def _plan(c: Canary, n: int) -> list[tuple[int, int, int, int]]:
    p = c.sweep_plan
    return list(zip(p.slot[:n].tolist(), p.pred[:n].tolist(), p.position[:n].tolist(), p.token[:n].tolist(),
                    strict=True))


def _converted(monkeypatch) -> list[list[int]]:
    """Each call of the runs' conversion: the first slot of each run it converted."""
    calls = []
    convert = sweep_module._entries
    monkeypatch.setattr(sweep_module, "_entries",
                        lambda runs, *a: calls.append([int(r.slots[0]) for r in runs]) or convert(runs, *a))
    return calls


@pytest.mark.parametrize("device,fused", PATHS)
@pytest.mark.parametrize("seed", [11, 12])
def test_a_prefetched_sweep_converts_nothing_and_loads_and_finds_what_a_plain_one_does(seed, device, fused,
                                                                                      monkeypatch):
    c, slots, tokens = prefilled(seed, device, NUM_SLOTS, CTX, 12, 256, fused)
    keep = random.Random(seed).randint(1, 6)
    runs = _runs(slots, tokens, keep)
    calls = _converted(monkeypatch)
    n = c.prefetch_sweep(runs)
    assert n == sum(len(s) - keep for s in slots) and calls == [[r.slots[0].item() for r in runs]]
    assert c.sweep(runs, hold=True) == n and len(calls) == 1  # built already: converted nothing
    want = [(s, s_[i - 1], i, t) for s_, t_ in zip(slots, tokens, strict=True)
            for i, (s, t) in enumerate(zip(s_, t_, strict=True)) if i >= keep]
    assert _plan(c, n) == want and c.held.tolist() == [w[0] for w in want]
    assert read_all(c, 1) == []
    # a run changed between the prefetch and the sweep is converted again, the rest is not: a wrong
    # token in its new tuple is a VERIFY_TOKEN at SWEEP on exactly that slot
    k = random.Random(seed).randrange(len(runs[1].token_ids))
    wrong = list(runs[1].token_ids)
    wrong[k] = (wrong[k] + 1) % 30_000
    assert c.prefetch_sweep(runs) == n and len(calls) == 1  # nothing new: nothing converted
    runs[1] = SweepRun(runs[1].slots, tuple(wrong), keep, runs[1].prev_slot)
    assert c.sweep(runs) == n and calls[1:] == [[runs[1].slots[0].item()]]
    assert [(v.slot, v.point.name, v.reasons) for v in read_all(c, 3)] == [
        (slots[1][keep + k], "SWEEP", Reason.VERIFY_TOKEN)]


@pytest.mark.parametrize("device,fused", PATHS)
def test_a_run_written_in_place_after_its_prefetch_is_swept_as_it_is_now(device, fused, monkeypatch):
    """The run's slot tensor written in place (its version moves): the sweep converts it again and
    verifies the slots it holds now, not the prefetched ones (a slot moved to another run's is a
    CHAIN break there); its twin, unwritten, reports nothing."""
    c, slots, tokens = prefilled(13, device, NUM_SLOTS, CTX, 12, 256, fused)
    runs = _runs(slots, tokens, 1)
    calls = _converted(monkeypatch)
    c.prefetch_sweep(runs)
    c.sweep(runs)
    assert len(calls) == 1 and read_all(c, 1) == []
    c.prefetch_sweep(runs)
    moved = slots[2][3]
    runs[0].slots[2] = moved  # in place: the record at that slot belongs to another sequence
    c.sweep(runs)
    assert calls[1:] == [[runs[0].slots[0].item()]]
    got = {(v.slot, v.point.name) for v in read_all(c, 3)}
    assert (moved, "SWEEP") in got and all(point == "SWEEP" for _, point in got)


def test_prefetch_refuses_what_is_not_a_run_before_it_keeps_anything(monkeypatch):
    c, slots, tokens = prefilled(14, "cpu", NUM_SLOTS, CTX, 12, 256, False)
    runs = _runs(slots, tokens, 1)
    calls = _converted(monkeypatch)
    with pytest.raises(KVCanaryError, match=r"prefetch_sweep runs\[1\] must be a SweepRun, got tuple"):
        c.prefetch_sweep([runs[0], tuple(runs[1].slots.tolist()), runs[2]])
    with pytest.raises(KVCanaryError, match=r"prefetch_sweep runs must be a sequence of SweepRun, got Tensor"):
        c.prefetch_sweep(runs[0].slots)
    assert calls == []
    c.sweep(runs)
    assert calls == [[r.slots[0].item() for r in runs]] and read_all(c, 1) == []


def test_a_disabled_canary_prefetches_nothing():
    c = Canary(CanaryConfig(policy=Policy.OFF), PoolGeometry(NUM_SLOTS, 4, CTX, "cpu"))
    run = SweepRun(torch.arange(8, 16), tuple(range(8)), 0)
    assert c.prefetch_sweep([run]) == 0
