"""Warm-up: compile every kernel variant a canary will launch before its first step.

Triton compiles a kernel the first time it is launched with a new set of compile-time constants
and argument dtypes; on an H200 that is hundreds of milliseconds to seconds per variant, paid by
whichever step first needs it. Each route (``runtime.forward``) warms its own launches on empty
batches (one padding request, nothing read, nothing written); the canary then warms the truth
scatter's variants and its sweeps:

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
violation ring's counter and the sweep plan's count are restored afterwards (``restored``), so a
warmed-up canary is indistinguishable from a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvcanary.ops.scatter import SCATTER_VARIANTS, scatter_validated
from kvcanary.runtime.batch import ForwardBatch


def empty_batch(device: torch.device, bs: int, truth: bool, rows: int, num_slots: int, window: int) -> ForwardBatch:
    """``bs`` padding requests (row 0) that read and write nothing; ``rows``: the truth table's
    rows (the page table's must match them); ``window`` > 0: with a slot table of ``num_slots``."""
    i64 = dict(dtype=torch.int64, device=device)
    zeros = torch.zeros(bs, **i64)
    none = torch.zeros(0, **i64)
    return ForwardBatch(req_pool_indices=zeros, prefix_lens=zeros, extend_lens=zeros.clone(),
                        req_to_token=torch.zeros(rows, 16, dtype=torch.int32, device=device), input_ids=none,
                        positions=none.clone(), out_cache_loc=none.clone(),
                        truth_ids=none.clone() if truth else None,
                        truth_offsets=torch.zeros(bs + 1, **i64) if truth else None,
                        slot_lut=torch.zeros(num_slots, **i64) if window else None)


def warm_scatter(error: torch.Tensor) -> None:
    """Launch the truth scatter's Triton variants once each, whole histories and appends.
    ``error``: the canary's own error word: its address (8 past a multiple of 16 in the counter
    block) is part of the variant, so a fresh flag would compile one no step launches."""
    dev = error.device
    flat = torch.zeros(1, dtype=torch.int64, device=dev)
    offsets = torch.tensor([0, 1], dtype=torch.int64, device=dev)
    lens = torch.zeros(1, dtype=torch.int64, device=dev)  # prepare_head's
    for variant in SCATTER_VARIANTS:
        for starts in (None, offsets[:1]):  # whole histories and appends (``ForwardBatch.truth_starts``)
            scatter_validated(flat, offsets, offsets[:1], torch.zeros(1, 1024, dtype=torch.int32, device=dev),
                              error, lens, True, starts, variant)


@contextmanager
def restored(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put ``tensors`` back as they were once the block is done (the counters a warm-up moved)."""
    saved = [(t, t.clone()) for t in tensors]
    yield
    for t, before in saved:
        t.copy_(before)
