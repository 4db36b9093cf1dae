"""Canary.warmup: every launch point runs once on an empty batch and leaves no trace (records,
counters, ring, sweep plan as built); afterwards the canary checks as before. On CUDA, a step of
any batch size after construction compiles nothing new."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint
from kvcanary.ops._common import HAS_TRITON
from kvcanary.ops.check_kernel import _check_kernel
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.ops.landed import _mark_kernel
from kvcanary.ops.scatter import _scatter_kernel
from kvcanary.ops.verify import _verify_kernel
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS, ROWS, MAX_CTX = 64, 4, 16


def _canary(truth: bool, window: int = 0, warmup: bool = False, fused: bool = True) -> Canary:
    gen = torch.Generator().manual_seed(1)
    kv = torch.randint(-1000, 1000, (NUM_SLOTS, 2, 8), generator=gen, dtype=torch.int16).to(DEV)
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, truth=truth, fused=fused, max_bs=4, max_tokens=64)
    return Canary(config, PoolGeometry(NUM_SLOTS, ROWS, MAX_CTX, DEV), sources=[KVSource.from_buffer(kv)],
                  window=window, warmup=warmup)


def _batch(prefix: int, extend: int, lut: torch.Tensor | None = None) -> ForwardBatch:
    gen = torch.Generator().manual_seed(2)
    table = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32)
    table[1] = (torch.randperm(NUM_SLOTS - 1, generator=gen)[:MAX_CTX] + 1).to(torch.int32)
    tokens = torch.randint(1, 500, (MAX_CTX,), generator=gen)
    pos = torch.arange(prefix, prefix + extend)
    return ForwardBatch(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([prefix]),
                        extend_lens=torch.tensor([extend]), req_to_token=table, input_ids=tokens[pos], positions=pos,
                        out_cache_loc=table[1, pos].long(), truth_ids=tokens[: prefix + extend],
                        truth_offsets=torch.tensor([0, prefix + extend]), slot_lut=lut)


def _forward(c: Canary, b: ForwardBatch) -> None:
    """HEAD, the model's K/V writes of ``b`` (fresh values in the covered rows), TAIL."""
    c.head(b)
    rows = c.sources[0].words.view(NUM_SLOTS, -1)
    rows[b.out_cache_loc] = torch.randint(-(2**31), 2**31 - 1, (b.out_cache_loc.shape[0], rows.shape[1]),
                                          dtype=torch.int32).to(rows.device)
    c.tail(b)


def _to(b: ForwardBatch) -> ForwardBatch:
    return ForwardBatch(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})


def _state(c: Canary) -> list[torch.Tensor]:
    st = c.state
    return [t.clone() for t in (st.records, st.stats, st.ring_counter, st.ring, st.error, c.truth, c.sweep_plan.count,
                                c.sweep_plan.enable)]


@pytest.mark.parametrize("truth, window, fused", [(False, 0, True), (True, 0, True), (True, 8, True),
                                                  (True, 0, False)])
def test_warmup_leaves_no_trace_and_the_canary_still_checks(truth, window, fused):
    c = _canary(truth, window, fused=fused)
    lut = torch.arange(NUM_SLOTS) if window else None
    fill = _to(_batch(0, 10, lut))
    _forward(c, fill)
    before = _state(c)
    seconds = c.warmup()
    assert seconds > 0 and c.warmup_seconds == seconds
    for got, want in zip(_state(c), before, strict=True):
        assert torch.equal(got, want)
    step = _to(_batch(10, 1, lut))
    _forward(c, step)
    assert int(c.state.ring_counter[0]) == 0
    assert int(c.state.stats[c.tag(LaunchPoint.HEAD), 0]) == 2  # the fill's and the step's launches only
    c.state.records[int(fill.out_cache_loc[3])] ^= 1
    c.head(step)
    assert int(c.state.ring_counter[0]) > 0


def _compiled() -> int | None:
    """Variants compiled so far of every kernel a canary's steps launch on CUDA."""
    counts = []
    for kernel in (_check_kernel, _mark_kernel, _scatter_kernel, _verify_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        counts.append(sum(len(v[0]) for v in caches.values()))
    return sum(counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles happen on CUDA only")
def test_no_step_compiles_after_construction():
    c = _canary(truth=True, warmup=True)
    n = _compiled()
    if n is None:
        pytest.skip("this triton keeps no per-device kernel cache to count")
    for prefix, extend in ((0, 3), (3, 1), (4, 12), (0, 16), (15, 1)):  # token counts 1, % 16 == 0 and others
        b = _to(_batch(prefix, extend))
        c.head(b)
        c.tail(b)
    appended = _batch(4, 1)  # a decode's truth as an append (ForwardBatch.truth_starts)
    appended = ForwardBatch(**{**vars(appended), "truth_ids": appended.input_ids.clone(),
                               "truth_offsets": torch.tensor([0, 1]), "truth_starts": torch.tensor([4])})
    appended = _to(appended)
    c.head(appended)
    c.tail(appended)
    assert _compiled() == n
    # a captured forward takes the side stream (Overlap.CAPTURED): its HEAD, marks and TAIL variants
    assert c.side is not None and not c.side_eager
    c.prepare_head(appended)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.launch_head(appended)
        c.start_tail(appended)
        c.tail(appended)
    graph.replay()
    c.end_step(0)
    assert _compiled() == n
