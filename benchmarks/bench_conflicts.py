"""CPU cost of HEAD's write-conflict check (torch path) next to the rest of HEAD, interleaved.

    python benchmarks/bench_conflicts.py

A decode batch (bs requests, prefix P each, one token written) and a prefill batch (T tokens
written by a few requests) over a pool of 16384 slots: median wall microseconds of build_plan +
verify + stamp (HEAD without the check) and of check_writes, measured in alternation.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcanary.ops.backend import Backend
from kvcanary.ops.conflicts import check_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.stamp import stamp
from kvcanary.ops.state import DeviceState
from kvcanary.ops.verify import verify


def batch(prefix: list[int], extend: list[int], num_slots: int = 16384):
    bs, gen = len(prefix), torch.Generator().manual_seed(0)
    slots = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    rtt = torch.zeros(bs + 1, max(p + e for p, e in zip(prefix, extend, strict=True)) + 1, dtype=torch.int32)
    loc = []
    for r, (p, e) in enumerate(zip(prefix, extend, strict=True)):
        mine, slots = slots[: p + e], slots[p + e:]
        rtt[r + 1, : p + e] = torch.tensor(mine, dtype=torch.int32)
        loc += mine[p:]
    n = len(loc)
    return dict(rpi=torch.arange(1, bs + 1), prefix=torch.tensor(prefix), extend=torch.tensor(extend), rtt=rtt,
                loc=torch.tensor(loc), ids=torch.randint(0, 1000, (n,)), pos=torch.arange(n), num_slots=num_slots)


def time_pair(b: dict, reps: int = 200) -> tuple[float, float]:
    state = DeviceState.allocate(b["num_slots"], ring_capacity=1 << 16)
    plan = Plan.allocate(int(b["prefix"].sum()) + 1, len(b["rpi"]))
    head, conflicts = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        build_plan(req_pool_indices=b["rpi"], prefix_lens=b["prefix"], extend_lens=b["extend"], req_to_token=b["rtt"],
                   plan=plan, backend=Backend.TORCH)
        verify(state=state, plan=plan, tag=0, backend=Backend.TORCH)
        bs = len(b["rpi"])
        stamp(state=state, out_cache_loc=b["loc"], input_ids=b["ids"], positions=b["pos"], req_pool_indices=b["rpi"],
              prefix_lens=b["prefix"], write_offsets=plan.write_offsets[: bs + 1], seed=plan.seed[:bs], tag=0,
              backend=Backend.TORCH)
        t1 = time.perf_counter()
        check_writes(state=state, plan=plan, out_cache_loc=b["loc"], input_ids=b["ids"], positions=b["pos"],
                     req_pool_indices=b["rpi"], write_offsets=plan.write_offsets[: bs + 1], tag=0,
                     backend=Backend.TORCH)
        t2 = time.perf_counter()
        head.append(t1 - t0)
        conflicts.append(t2 - t1)
        state.ring_counter.zero_()
    return statistics.median(head) * 1e6, statistics.median(conflicts) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    cases = {"decode bs=32, prefix 200": ([200] * 32, [1] * 32), "prefill 4 x 128 tokens": ([0, 40, 0, 80], [128] * 4)}
    for name, (prefix, extend) in cases.items():
        head, conf = time_pair(batch(prefix, extend))
        print(f"{name}: HEAD without the check {head:.0f} us, check_writes {conf:.0f} us (+{100 * conf / head:.0f}%)")


if __name__ == "__main__":
    main()
