"""Host cost of the per-call DeviceState check, next to the ring validation it replaced.

    python benchmarks/bench_state.py [--device cpu|cuda]

Every op checks its ``state=`` once per call: the buffers' addresses and shapes against those
validated at construction (``DeviceState.check``), then the launch tag and, for host tensors,
the ring counter's value (``validate_ring``). Before the DeviceState, ops validated the loose
ring, counter and stats tensors (dtype, rank, shape, contiguity, device) on every call; that
validation is timed here from its formula (``loose_ring_checks``). Best of 5 x 20,000 calls.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS, VIOLATION_ROW_WIDTH
from kvcanary.ops.state import DeviceState
from kvcanary.ops.validation import check_same_device, check_tensor, validate_ring


def loose_ring_checks(ring, ring_counter, stats, tag: int) -> None:
    """What each op checked per call on the loose tensors before (the former validate_ring)."""
    check_tensor("ring", ring, torch.int64, 2)
    if ring.shape[1] != VIOLATION_ROW_WIDTH or not ring.is_contiguous():
        raise ValueError("ring")
    check_tensor("ring_counter", ring_counter, torch.int64, 1)
    check_tensor("stats", stats, torch.int64, 2)
    if tuple(stats.shape) != (NUM_LAUNCH_TAGS, NUM_STATS):
        raise ValueError("stats")
    if not 0 <= int(tag) < NUM_LAUNCH_TAGS:
        raise ValueError("tag")
    check_same_device(ring=ring, ring_counter=ring_counter, stats=stats)


def best_us(fn, n: int = 20_000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    dev = p.parse_args().device
    state = DeviceState.allocate(4096, ring_capacity=4096, max_bs=1024, max_tokens=1 << 20, device=dev)
    rows = [("DeviceState.check()", best_us(state.check)),
            ("validate_ring(state, tag): check + tag + host counter value", best_us(lambda: validate_ring(state, 3))),
            ("loose ring/counter/stats checks (before)",
             best_us(lambda: loose_ring_checks(state.ring, state.ring_counter, state.stats, 3)))]
    for name, us in rows:
        print(f"{name:<62} {us:6.2f} us")


if __name__ == "__main__":
    main()
