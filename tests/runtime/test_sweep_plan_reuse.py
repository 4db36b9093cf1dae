"""A sweep over the entries its plan holds already (the same runs, unchanged, swept again) launches
the verify on the plan as it is, copying nothing, and still reports damage done since; anything
else that loads the plan (a landed copy's check) makes the next sweep load its own entries again.
On the CPU through the ops one by one and through the interpreted Triton kernels, and on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import FINGERPRINT, Reason, record_words
from kvcanary.runtime.sweep import SweepRun

from ._helpers import prefilled, read_all

NUM_SLOTS, CTX = 300, 64

PATHS = [pytest.param("cpu", False, id="cpu-ops"),
         pytest.param("cpu", True, id="cpu-triton", marks=pytest.mark.skipif(
             torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case runs the kernel)")),
         pytest.param("cuda", None, id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device,fused", PATHS)
@pytest.mark.parametrize("seed", [5, 6])
def test_a_sweep_over_the_entries_its_plan_holds_copies_nothing_and_still_reports_damage(seed, device, fused,
                                                                                         monkeypatch):
    c, slots, tokens = prefilled(seed, device, NUM_SLOTS, CTX, 12, 256, fused)
    keep = 2
    runs = [SweepRun(torch.tensor(s[keep:], dtype=torch.int64), tuple(t[keep:]), keep, s[keep - 1])
            for s, t in zip(slots, tokens, strict=True)]  # one list, swept again and again
    loads = []
    load = c._load_sweep_plan
    monkeypatch.setattr(c, "_load_sweep_plan", lambda *cols: loads.append(len(cols[0])) or load(*cols))
    n = c.sweep(runs)
    assert n == sum(len(s) - keep for s in slots) and loads == [n]
    assert c.sweep(runs) == n and loads == [n]  # launched on the plan as it is
    assert read_all(c, 1) == []
    bad = slots[0][keep + 3]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # its own word only: no successor's chain moves
    assert c.sweep(runs) == n and loads == [n]
    assert [(v.slot, v.point.name, v.reasons) for v in read_all(c, 3)] == [(bad, "SWEEP", Reason.FINGERPRINT)]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # repaired
    c.verify_landed(torch.tensor(slots[2][:4]))  # loads the plan with other entries ...
    assert c.sweep(runs) == n and loads == [n, 4, n]  # ... so the next sweep loads its own again
    want = [(s, s_[i - 1], i, t) for s_, t_ in zip(slots, tokens, strict=True)
            for i, (s, t) in enumerate(zip(s_, t_, strict=True)) if i >= keep]
    p = c.sweep_plan
    assert list(zip(p.slot[:n].tolist(), p.pred[:n].tolist(), p.position[:n].tolist(), p.token[:n].tolist(),
                    strict=True)) == want
    assert read_all(c, 5) == []
    runs[1] = SweepRun(runs[1].slots.clone(), runs[1].token_ids, keep, runs[1].prev_slot)  # another tensor
    assert c.sweep(runs) == n and loads == [n, 4, n, n]  # new arrays: loaded, though the values are the same
