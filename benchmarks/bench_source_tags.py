"""CPU cost of the per-source fingerprint tags (torch path), next to the ops that carry them.

    python benchmarks/bench_source_tags.py

A pool of 16384 slots with 4 KV sources (K and V of two layers, 8 heads x 128 dims bf16 = 2 KiB
per row), mode ALL. Median wall microseconds, interleaved:
- TAIL's record: ``fingerprint(record=True)`` of T written slots, next to the work the side word
  adds to it (packing 16 bits of each source's part, storing the word);
- a clean verify of P prefix entries with fingerprints, next to the tag-column work it adds
  (gathering the side words, ``mismatch_tag_torch`` over every lane, as the torch path does).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcanary.core.record import Half
from kvcanary.ops.backend import Backend
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, mismatch_tag_torch
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceState
from kvcanary.ops.verify import verify

NUM_SLOTS, ROW = 16384, 8 * 128 * 2


def setup():
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randint(0, 256, (NUM_SLOTS, ROW), dtype=torch.uint8, generator=gen) for _ in range(4)]
    sources = [KVSource.from_buffer(b, half=Half(i % 2), layer=i // 2) for i, b in enumerate(bufs)]
    return sources, DeviceState.allocate(NUM_SLOTS, ring_capacity=1 << 12)


def median_us(fns, reps: int) -> list[float]:
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns, strict=True):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
    return [statistics.median(t) for t in times]


def record_case(sources, state, n: int, reps: int) -> tuple[float, float]:
    slots = torch.randperm(NUM_SLOTS - 1)[:n] + 1
    parts = torch.randint(-(2**62), 2**62, (len(sources), n))
    shifts = torch.arange(len(sources))[:, None] * 16

    def full():
        fingerprint(slots=slots, sources=sources, mode=FingerprintMode.ALL, state=state, record=True,
                    backend=Backend.TORCH)

    def added():
        state.source_tags[slots] = ((parts & 0xFFFF) << shifts).sum(dim=0)

    return tuple(median_us([full, added], reps))


def verify_case(sources, state, n: int, reps: int) -> tuple[float, float]:
    slots = torch.randperm(NUM_SLOTS - 1)[:n] + 1
    fingerprint(slots=slots, sources=sources, mode=FingerprintMode.ALL, state=state, record=True,
                backend=Backend.TORCH)
    plan = Plan.allocate(n, 1)
    plan.slot[:n] = slots.to(torch.int32)
    plan.pred[:n] = -1
    plan.position[:n] = 1  # no chain check (pred -1, position > 0); positions as stamped below
    state.records.view(torch.int64)[slots, 1] = 1
    plan.token[:n] = -1
    plan.count.fill_(n)
    plan.enable.fill_(1)
    exp = state.source_tags[slots] ^ 1
    bad = torch.zeros(n, dtype=torch.bool)

    def full():
        verify(state=state, plan=plan, tag=4, sources=sources, mode=FingerprintMode.ALL, backend=Backend.TORCH)

    def added():
        mismatch_tag_torch(4, bad, state.source_tags[slots], exp, sources)  # the gather of the side words too

    out = median_us([full, added], reps)
    assert int(state.ring_counter[0]) == 0, "the clean verify reported violations"
    return tuple(out)


def main() -> None:
    torch.set_num_threads(1)
    sources, state = setup()
    print("| case | op | side-word work | added |")
    print("|---|---:|---:|---:|")
    for n in (32, 512):
        op, extra = record_case(sources, state, n, 200)
        print(f"| TAIL record, {n} written slots | {op:.0f} | {extra:.0f} | +{100 * extra / op:.1f} % |")
    for n in (512, 4096):
        op, extra = verify_case(sources, state, n, 100)
        print(f"| clean verify, {n} prefix entries | {op:.0f} | {extra:.0f} | +{100 * extra / op:.1f} % |")


if __name__ == "__main__":
    main()
