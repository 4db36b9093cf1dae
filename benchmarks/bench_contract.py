"""Host cost of the contract checks and the incident bookkeeping added to every forward (CPU).

Times, interleaved in one run: building a decode ForwardBatch (bs requests, every field checked)
against the same dataclass built without its checks; and a whole canary step (HEAD, TAIL,
end_step) on a clean pool against the same step while one damaged slot is re-detected every step
(an open incident: rewrite tracking and the incident lookup run). Prints medians in µs.

    python benchmarks/bench_contract.py --bs 64 --context 256 --repeats 200
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, Half, KVSource, PoolGeometry


def decode_batch(bs: int, context: int, table: torch.Tensor, tokens: torch.Tensor, validate: bool = True):
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
    rows = torch.arange(1, bs + 1)
    kw = dict(req_pool_indices=rows, prefix_lens=torch.full((bs,), context),
              extend_lens=torch.ones(bs, dtype=torch.int64), req_to_token=table, input_ids=tokens[:, context].clone(),
              positions=torch.full((bs,), context),
              out_cache_loc=table[1:, context].long(), truth_ids=tokens[:, : context + 1].flatten(),
              truth_offsets=i64(range(0, bs * (context + 1) + 1, context + 1)), request_ids=tuple(range(bs)))
    if validate:
        return ForwardBatch(**kw)
    batch = object.__new__(ForwardBatch)  # the same frozen dataclass, its checks skipped
    for f in dataclasses.fields(ForwardBatch):
        object.__setattr__(batch, f.name, kw.get(f.name))
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    gen = torch.Generator().manual_seed(0)
    num_slots = a.bs * (a.context + 1) + 1
    table = torch.zeros(a.bs + 1, a.context + 1, dtype=torch.int32)
    table[1:] = (torch.randperm(num_slots - 1, generator=gen) + 1).view(a.bs, a.context + 1).int()
    tokens = torch.randint(1, 32000, (a.bs, a.context + 1), generator=gen)
    timings: dict[str, list[float]] = {"batch checked": [], "batch unchecked": [], "step clean": [],
                                       "step with an open incident": []}
    canaries = {}
    for name in ("step clean", "step with an open incident"):
        k, v = torch.randn(num_slots, 8, 16, generator=gen), torch.randn(num_slots, 8, 16, generator=gen)
        c = Canary(CanaryConfig(sweep_interval=0, incident_summary_steps=0), PoolGeometry(num_slots, a.bs + 1,
                   a.context + 1), sources=[KVSource.from_buffer(k, half=Half.K), KVSource.from_buffer(v, half=Half.V)])
        prefill = ForwardBatch(torch.arange(1, a.bs + 1), torch.zeros(a.bs, dtype=torch.int64),
                               torch.full((a.bs,), a.context), table, tokens[:, : a.context].flatten(),
                               torch.arange(a.context).repeat(a.bs), table[1:, : a.context].flatten().long(),
                               tokens[:, : a.context + 1].flatten(),
                               torch.arange(0, a.bs * (a.context + 1) + 1, a.context + 1))
        with c.forward(prefill):
            pass
        c.end_step(0)
        if name != "step clean":
            k[int(table[1, 3])] += 1.0  # read by every decode below: an open incident re-detected each step
        canaries[name] = (c, k)
    batch = decode_batch(a.bs, a.context, table, tokens)
    for i in range(a.repeats):
        for name, validate in (("batch checked", True), ("batch unchecked", False)):
            t0 = time.perf_counter()
            decode_batch(a.bs, a.context, table, tokens, validate)
            timings[name].append(time.perf_counter() - t0)
        for name, (c, _) in canaries.items():
            t0 = time.perf_counter()
            with c.forward(batch):
                pass
            c.end_step(i + 1)
            timings[name].append(time.perf_counter() - t0)
    for name, ts in timings.items():
        print(f"{name:28s} median {statistics.median(ts) * 1e6:9.1f} us")
    c = canaries["step with an open incident"][0]
    print(f"open-incident canary: {c.totals.violations} violations, {c.incidents.num_incidents} incident(s)")


if __name__ == "__main__":
    main()
