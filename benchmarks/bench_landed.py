"""CPU cost of the missed-write check (torch path) next to the rest of HEAD and TAIL, interleaved.

    python benchmarks/bench_landed.py

A decode batch (bs requests, prefix P each, one token written) and a prefill batch (T tokens
written by a few requests) over a pool of 16384 slots with four KV sources shaped like an 8B
model's rows (8 KV heads x 128 dims, bf16: 2048 bytes; layers 0 and 31, K and V), real-KV mode
partial: median wall microseconds of HEAD without the mark (build_plan + verify + check_writes +
stamp) next to ``mark_writes``, and of TAIL without the check (verify with fingerprints +
fingerprint(record)) next to ``check_writes_landed``, each pair measured in alternation. The
forward's writes are simulated between HEAD and TAIL (not timed), so every repetition is clean.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_conflicts import batch  # noqa: E402
from kvcanary.core.record import Half  # noqa: E402
from kvcanary.ops.backend import Backend  # noqa: E402
from kvcanary.ops.conflicts import check_writes  # noqa: E402
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint  # noqa: E402
from kvcanary.ops.landed import check_writes_landed, mark_writes  # noqa: E402
from kvcanary.ops.plan import Plan, build_plan  # noqa: E402
from kvcanary.ops.stamp import stamp  # noqa: E402
from kvcanary.ops.state import DeviceState  # noqa: E402
from kvcanary.ops.verify import verify  # noqa: E402

MODE = FingerprintMode.PARTIAL
T = Backend.TORCH


def sources(num_slots: int) -> list[KVSource]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for layer in (0, 31):
        for half in Half:
            buf = torch.randint(-(2**15), 2**15 - 1, (num_slots, 8, 128), dtype=torch.int16, generator=gen)
            out.append(KVSource.from_buffer(buf.view(torch.bfloat16), half=half, layer=layer))
    return out


def time_step(b: dict, reps: int = 100) -> dict[str, float]:
    state = DeviceState.allocate(b["num_slots"], ring_capacity=1 << 16)
    plan = Plan.allocate(int(b["prefix"].sum()) + 1, len(b["rpi"]))
    src = sources(b["num_slots"])
    bs, loc = len(b["rpi"]), b["loc"]
    fresh = torch.randint(-(2**31), 2**31 - 1, (len(loc), 4), dtype=torch.int32)
    times: dict[str, list[float]] = {"head": [], "mark": [], "tail": [], "landed": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        build_plan(req_pool_indices=b["rpi"], prefix_lens=b["prefix"], extend_lens=b["extend"], req_to_token=b["rtt"],
                   plan=plan, backend=T)
        verify(state=state, plan=plan, tag=0, backend=T)
        woff = plan.write_offsets[: bs + 1]
        check_writes(state=state, plan=plan, out_cache_loc=loc, input_ids=b["ids"], positions=b["pos"],
                     req_pool_indices=b["rpi"], write_offsets=woff, tag=0, backend=T)
        stamp(state=state, out_cache_loc=loc, input_ids=b["ids"], positions=b["pos"], req_pool_indices=b["rpi"],
              prefix_lens=b["prefix"], write_offsets=woff, seed=plan.seed[:bs], tag=0, backend=T)
        t1 = time.perf_counter()
        mark_writes(state=state, out_cache_loc=loc, sources=src, backend=T)
        t2 = time.perf_counter()
        for s in src:  # the forward's writes (not timed)
            s.words.view(s.num_slots, -1)[loc, :4] = fresh
        t3 = time.perf_counter()
        verify(state=state, plan=plan, tag=4, sources=src, mode=MODE, backend=T)
        fingerprint(slots=loc, sources=src, mode=MODE, state=state, record=True, backend=T)
        t4 = time.perf_counter()
        landed = check_writes_landed(state=state, out_cache_loc=loc, input_ids=b["ids"], positions=b["pos"],
                                     sources=src, tag=4, backend=T)
        t5 = time.perf_counter()
        assert bool(landed.all())
        for k, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
            times[k].append(dt)
        state.ring_counter.zero_()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    cases = {"decode bs=32, prefix 200": ([200] * 32, [1] * 32), "prefill 4 x 128 tokens": ([0, 40, 0, 80], [128] * 4)}
    print("| batch | HEAD without the mark | mark_writes | added | TAIL without the check | check_writes_landed | "
          "added |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (prefix, extend) in cases.items():
        t = time_step(batch(prefix, extend))
        print(f"| {name} | {t['head']:.0f} | {t['mark']:.0f} | +{100 * t['mark'] / t['head']:.0f} % | {t['tail']:.0f} "
              f"| {t['landed']:.0f} | +{100 * t['landed'] / t['tail']:.0f} % |")


if __name__ == "__main__":
    main()
