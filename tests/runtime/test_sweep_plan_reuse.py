"""A sweep over the entries its plan holds already (the same runs, unchanged, swept again) launches
the verify on the plan as it is, copying nothing, and still reports damage done since; anything
else that loads the plan (a landed copy's check) makes the next sweep load its own entries again.
On the CPU through the ops one by one and through the interpreted Triton kernels, and on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import FINGERPRINT, Half, record_words
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.runtime.sweep import SweepRun

NUM_SLOTS, ROWS, CTX = 300, 4, 64

PATHS = [pytest.param("cpu", False, id="cpu-ops"),
         pytest.param("cpu", True, id="cpu-triton", marks=pytest.mark.skipif(
             torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case runs the kernel)")),
         pytest.param("cuda", None, id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")])]


def _filled(seed: int, device: str, fused) -> tuple[Canary, list[list[int]], list[list[int]]]:
    """A canary whose rows 1..3 were prefilled (random slots and tokens): their slots and tokens."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(NUM_SLOTS, 2, 16, generator=gen).to(device, torch.bfloat16)
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=4, max_tokens=256, sweep_interval=0, fused=fused)
    c = Canary(config, PoolGeometry(NUM_SLOTS, ROWS, CTX, device), sources=[KVSource.from_buffer(kv, half=Half.K)])
    lens = torch.randint(12, CTX, (3,), generator=gen).tolist()
    perm = (torch.randperm(NUM_SLOTS - 1, generator=gen) + 1).tolist()
    slots, tokens, at = [], [], 0
    for n in lens:
        slots.append(perm[at: at + n])
        tokens.append(torch.randint(0, 30_000, (n,), generator=gen).tolist())
        at += n
    table = torch.zeros(ROWS, CTX, dtype=torch.int32)
    for r, s in enumerate(slots, start=1):
        table[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
    b = ForwardBatch(i64([1, 2, 3]), i64([0, 0, 0]), i64(lens), table.to(device), i64(sum(tokens, [])),
                     i64([p for n in lens for p in range(n)]), i64(sum(slots, [])))
    with c.forward(b):
        kv[b.out_cache_loc] = torch.randn(b.out_cache_loc.numel(), 2, 16, generator=gen).to(device, torch.bfloat16)
    c.end_step(0)
    return c, slots, tokens


def _read(c: Canary, step: int) -> list:
    """The violations of what ran since the last report: the step's end, then everything pending."""
    return c.end_step(step).violations + c.flush(step + 1).violations


@pytest.mark.parametrize("device,fused", PATHS)
@pytest.mark.parametrize("seed", [5, 6])
def test_a_sweep_over_the_entries_its_plan_holds_copies_nothing_and_still_reports_damage(seed, device, fused,
                                                                                         monkeypatch):
    c, slots, tokens = _filled(seed, device, fused)
    keep = 2
    runs = [SweepRun(torch.tensor(s[keep:], dtype=torch.int64), tuple(t[keep:]), keep, s[keep - 1])
            for s, t in zip(slots, tokens, strict=True)]  # one list, swept again and again
    loads = []
    load = c._load_sweep_plan
    monkeypatch.setattr(c, "_load_sweep_plan", lambda *cols: loads.append(len(cols[0])) or load(*cols))
    n = c.sweep(runs)
    assert n == sum(len(s) - keep for s in slots) and loads == [n]
    assert c.sweep(runs) == n and loads == [n]  # launched on the plan as it is
    assert _read(c, 1) == []
    bad = slots[0][keep + 3]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # its own word only: no successor's chain moves
    assert c.sweep(runs) == n and loads == [n]
    assert [(v.slot, v.point.name) for v in _read(c, 3)] == [(bad, "SWEEP")]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # repaired
    c.verify_landed(torch.tensor(slots[2][:4]))  # loads the plan with other entries ...
    assert c.sweep(runs) == n and loads == [n, 4, n]  # ... so the next sweep loads its own again
    want = [(s, s_[i - 1], i, t) for s_, t_ in zip(slots, tokens, strict=True)
            for i, (s, t) in enumerate(zip(s_, t_, strict=True)) if i >= keep]
    p = c.sweep_plan
    assert list(zip(p.slot[:n].tolist(), p.pred[:n].tolist(), p.position[:n].tolist(), p.token[:n].tolist(),
                    strict=True)) == want
    assert _read(c, 5) == []
    runs[1] = SweepRun(runs[1].slots.clone(), runs[1].token_ids, keep, runs[1].prev_slot)  # another tensor
    assert c.sweep(runs) == n and loads == [n, 4, n, n]  # new arrays: loaded, though the values are the same
