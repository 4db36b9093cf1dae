"""Warm-up: compile every kernel variant a canary will launch before its first step.

Triton compiles a kernel the first time it is launched with a new set of compile-time constants
and argument dtypes; on an H200 that is hundreds of milliseconds to seconds per variant, paid by
whichever step first needs it. ``warm_up`` launches each of the canary's launch points once on an
empty batch (one padding request, nothing read, nothing written), so each variant is compiled:

| launch                         | variants                                                  |
|--------------------------------|-----------------------------------------------------------|
| HEAD, TAIL (``launch_head``, ``tail``) | with and without token truth (truth on), the pool's window table; |
|                                | with a side stream (``CanaryConfig.overlap``) both placements: eager and captured; |
|                                | TAIL publishing the counters (eager) and not (captured); HEAD taking |
|                                | its batch's truth scatter into its launch (eager, truth on, CUDA: |
|                                | whole histories and appends)                              |
| the unfused ops (``fused=False``) | the same, at each batch size of a new bit length up to ``max_bs`` |
| the truth scatter (truth on)   | each (block, warps) of ``SCATTER_VARIANTS``, whole histories and appends |
| SWEEP (the plan's verify)      | one; on CUDA then captured with the plan's load, one graph per size class |
|                                | (``runtime.sweep_graphs``)                                |

The launches touch no record (empty batches, an empty sweep plan); the launch counters, the
violation ring's counter and the sweep plan's count are restored afterwards, so a warmed-up
canary is indistinguishable from a fresh one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from kvcanary.ops.backend import Backend, use_triton
from kvcanary.ops.scatter import SCATTER_VARIANTS, scatter_validated
from kvcanary.runtime.batch import ForwardBatch

if TYPE_CHECKING:
    from kvcanary.runtime.canary import Canary

def _empty_batch(canary: Canary, bs: int, truth: bool) -> ForwardBatch:
    """``bs`` padding requests (row 0) that read and write nothing."""
    dev = canary.state.records.device
    i64 = dict(dtype=torch.int64, device=dev)
    zeros = torch.zeros(bs, **i64)
    none = torch.zeros(0, **i64)
    rows = canary.geometry.rows  # the page table's rows must match the truth table's
    return ForwardBatch(req_pool_indices=zeros, prefix_lens=zeros, extend_lens=zeros.clone(),
                        req_to_token=torch.zeros(rows, 16, dtype=torch.int32, device=dev), input_ids=none,
                        positions=none.clone(), out_cache_loc=none.clone(),
                        truth_ids=none.clone() if truth else None,
                        truth_offsets=torch.zeros(bs + 1, **i64) if truth else None,
                        slot_lut=torch.zeros(canary.geometry.num_slots, **i64) if canary.window else None)


def _batch_sizes(canary: Canary) -> list[int]:
    """One batch size per variant: the fused kernel's variants do not depend on it; the unfused
    ops specialise their segment search on its bit length."""
    if canary.fused:
        return [1]
    sizes, bs = [], 1
    while bs <= canary.config.max_bs:
        sizes.append(bs)
        bs *= 2
    return sizes


def warm_up(canary: Canary) -> float:
    """Launch every variant once (see module doc); returns the seconds it took (synchronised)."""
    if not canary.config.enabled:
        return 0.0
    dev = canary.state.records.device
    t0 = time.perf_counter()
    state, plan = canary.state, canary.sweep_plan
    saved = [(t, t.clone()) for t in (state.stats, state.ring_counter, state.error, plan.count, plan.enable,
                                      canary.truth_lens)]  # a HEAD taking the scatter writes the first length
    seconds = canary.totals.seconds
    # a captured forward takes the side stream (HEAD without marks, then the marks' own launch), an
    # eager one under Overlap.CAPTURED the current stream (HEAD marking): warm both where both are taken
    placements = sorted({canary.side_eager, canary.side is not None})
    # an eager TAIL publishes the counters from its launch, a captured one leaves that to the graph's
    # own publication: TAIL both ways where the canary publishes
    publishing = sorted({False, canary.publishing})
    side_eager, publishes = canary.side_eager, canary.publishing
    eager, canary._eager = canary._eager, None  # the launches themselves: a capture cannot compile
    try:
        for canary.side_eager in placements:
            for truth in sorted({False, bool(canary.config.truth)}):
                for bs in _batch_sizes(canary):
                    b = _empty_batch(canary, bs, truth)
                    canary.launch_head(b)
                    if truth and canary._truth_with_head:  # an eager HEAD taking its truth scatter:
                        # whole histories, then appends (``prepare_head(b, eager=True)`` without counting a forward)
                        for fold in (b, dataclasses.replace(b, truth_starts=b.prefix_lens)):
                            canary._scatter_for = fold
                            canary.launch_head(fold)
                    for canary.publishing in publishing:
                        canary.tail(b)
    finally:
        canary.side_eager, canary.publishing, canary._eager = side_eager, publishes, eager
    if canary.config.truth and use_triton(Backend.AUTO, dev):
        flat = torch.zeros(1, dtype=torch.int64, device=dev)
        offsets = torch.tensor([0, 1], dtype=torch.int64, device=dev)
        lens = torch.zeros(1, dtype=torch.int64, device=dev)  # prepare_head's
        for variant in SCATTER_VARIANTS:
            for starts in (None, offsets[:1]):  # whole histories and appends (``ForwardBatch.truth_starts``)
                # the state's own error word: its address (8 past a multiple of 16 in the counter block) is
                # part of the variant, so a fresh flag would compile one no step launches
                scatter_validated(flat, offsets, offsets[:1], torch.zeros(1, 1024, dtype=torch.int32, device=dev),
                                  state.error, lens, True, starts, variant)
    canary._load_sweep_plan([], [], [], [])
    canary._capture_sweeps()  # after the verify's compile: a capture cannot compile
    for t, before in saved:
        t.copy_(before)
    canary.totals.seconds = seconds
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
