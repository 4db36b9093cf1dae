"""A clean run of every op together, the way the runtime drives them: requests sharing prefix
slots, chunked prefill, decode steps and padding, with truth on. Each step: scatter truth ->
build_plan -> verify (HEAD) -> gather -> stamp -> write K/V -> verify (TAIL, fingerprints) ->
fingerprint(record). Zero violations, and the same canary bytes through both backends."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvcanary.core.hashing import chain_values, to_signed
from kvcanary.core.record import (
    CHAIN,
    STAT_CHECKED,
    STAT_LAUNCHES,
    STAT_STAMPED,
    Half,
    LaunchPoint,
    LaunchTag,
    new_ring,
    new_stats,
    record_words,
)
from kvcanary.ops._common import Backend
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import offsets_from_lengths, scatter_req_token_ids
from kvcanary.ops.stamp import stamp
from kvcanary.ops.verify import verify

from ._compare import assert_same
from ._helpers import BACKENDS, device_for, with_state

PAGE_SIZE = 4
NUM_SLOTS = 157  # odd, and not a multiple of the page size
ROWS, MAX_CTX = 8, 48
HEAD = LaunchTag(LaunchPoint.HEAD).value
TAIL = LaunchTag(LaunchPoint.TAIL, half=Half.K).value


@dataclass
class Request:
    row: int
    tokens: list[int]  # known so far: prompt, then sampled outputs
    cached: int = 0  # tokens whose K/V is in the pool
    slots: list[int] = field(default_factory=list)


@dataclass
class Step:
    """One forward: (request, number of tokens to write) plus padding requests."""

    work: list[tuple[Request, int]]
    padding: int = 0


def schedule(gen: torch.Generator) -> tuple[list[Step], list[Request]]:
    """Three requests share a 12-token prefix (one of them only its first 9 tokens), one stands
    alone; prefill goes in chunks, then every request decodes."""
    def ids(n):
        return torch.randint(1, 50_000, (n,), generator=gen).tolist()

    prefix = ids(12)
    r1, r2, r3, r4 = (Request(1, prefix + ids(3)), Request(2, prefix + ids(5)), Request(5, prefix[:9] + ids(4)),
                      Request(7, ids(11)))
    steps = [Step([(r1, 6), (r4, 5)], padding=1), Step([(r1, 9), (r4, 6)]), Step([(r2, 5), (r3, 4)], padding=2)]
    steps += [Step([(r, 1) for r in (r1, r2, r3, r4)], padding=k % 2) for k in range(4)]
    return steps, [r1, r2, r3, r4]


class Runner:
    def __init__(self, backend: Backend, mode: FingerprintMode, seed: int):
        self.backend, self.mode, self.dev = backend, mode, device_for(backend)
        self.gen = torch.Generator().manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.free = (torch.randperm(NUM_SLOTS - 1, generator=gen) + 1).tolist()
        pages = -(-NUM_SLOTS // PAGE_SIZE)
        self.kv = [torch.zeros(pages, PAGE_SIZE, 2, 16, dtype=torch.bfloat16, device=self.dev) for _ in range(2)]
        self.sources = [KVSource.from_buffer(b, page_size=PAGE_SIZE, half=Half(i)) for i, b in enumerate(self.kv)]
        self.canary = torch.zeros(NUM_SLOTS, 32, dtype=torch.uint8, device=self.dev)
        self.req_to_token = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32, device=self.dev)
        self.truth = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32, device=self.dev)
        self.plan = Plan.allocate(256, 8, device=self.dev)
        self.ring, self.counter = new_ring(32, device=self.dev)
        self.stats = new_stats(device=self.dev)
        self.kv_gen = torch.Generator().manual_seed(seed + 2)

    def t(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.dev)

    def share(self, req: Request, donor: Request, n: int) -> None:
        """Prefix-cache hit: ``req`` reuses the first ``n`` slots of ``donor``."""
        req.slots, req.cached = donor.slots[:n], n
        self.req_to_token[req.row, :n] = torch.tensor(req.slots, dtype=torch.int32)

    def run(self, step: Step) -> None:
        rows, prefix, extend, ids, pos, loc, truth_flat, truth_lens = [], [], [], [], [], [], [], []
        for req, n in step.work:
            while len(req.tokens) < req.cached + n:  # decode: write the token sampled last step
                req.tokens.append(int(torch.randint(1, 50_000, (1,), generator=self.gen)))
            new = self.free[:n]
            self.free = self.free[n:]
            self.req_to_token[req.row, req.cached: req.cached + n] = torch.tensor(new, dtype=torch.int32)
            rows.append(req.row)
            prefix.append(req.cached)
            extend.append(n)
            ids += req.tokens[req.cached: req.cached + n]
            pos += list(range(req.cached, req.cached + n))
            loc += new
            known = req.tokens[: req.cached + n]
            truth_flat += known
            truth_lens.append(len(known))
            req.slots += new
            req.cached += n
        for _ in range(step.padding):  # CUDA-graph padding: row 0, one token written to slot 0
            rows.append(0)
            prefix.append(0)
            extend.append(1)
            ids.append(0)
            pos.append(0)
            loc.append(0)
            truth_lens.append(0)
        b = dict(backend=self.backend)
        rpi, prefix_t, extend_t, truth_lens_t = self.t(rows), self.t(prefix), self.t(extend), self.t(truth_lens)
        flag = scatter_req_token_ids(flat_in=self.t(truth_flat), offsets=offsets_from_lengths(truth_lens_t),
                                     req_pool_indices=rpi, pool_out=self.truth, **b)
        assert flag.tolist() == [0]
        plan = build_plan(req_pool_indices=rpi, prefix_lens=prefix_t, extend_lens=extend_t,
                          req_to_token=self.req_to_token, plan=self.plan, truth=self.truth, truth_lens=truth_lens_t,
                          **b)
        assert plan.enable.tolist() == [1]
        ring = dict(ring=self.ring, ring_counter=self.counter, stats=self.stats)
        with_state(verify, canary=self.canary, plan=plan, tag=HEAD, **ring, **b)
        bs = len(rows)
        expected = gather_expected_tokens(truth=self.truth, truth_lens=truth_lens_t, req_pool_indices=rpi,
                                          prefix_lens=prefix_t, extend_offsets=plan.write_offsets[: bs + 1],
                                          input_ids=self.t(ids), **b)
        with_state(stamp, canary=self.canary, out_cache_loc=self.t(loc), input_ids=self.t(ids), positions=self.t(pos),
              req_pool_indices=rpi, prefix_lens=prefix_t, write_offsets=plan.write_offsets[: bs + 1],
              seed=plan.seed[:bs], expected_tokens=expected, tag=HEAD, **ring, **b)
        for buf in self.kv:  # the model writes K/V of the new tokens (padding into slot 0)
            for s in loc:
                buf[s // PAGE_SIZE, s % PAGE_SIZE] = torch.randn(2, 16, generator=self.kv_gen).to(buf.dtype)
        with_state(verify, canary=self.canary, plan=plan, tag=TAIL, sources=self.sources, mode=self.mode, **ring, **b)
        with_state(fingerprint, slots=self.t(loc), sources=self.sources, mode=self.mode, canary=self.canary,
                   record=True, **b)
        assert self.counter.tolist() == [0], self.ring[: int(self.counter)].tolist()


@pytest.mark.parametrize("mode", [FingerprintMode.PARTIAL, FingerprintMode.ALL], ids=lambda m: m.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_clean_pipeline_has_no_violations_and_backends_agree(mode, seed):
    canaries = {}
    for backend in BACKENDS:
        runner = Runner(backend, mode, seed)
        steps, requests = schedule(torch.Generator().manual_seed(seed))
        for i, step in enumerate(steps):
            if i == 2:  # r2 and r3 hit the prefix cache on r1's slots
                runner.share(requests[1], requests[0], 12)
                runner.share(requests[2], requests[0], 9)
            runner.run(step)
            canaries.setdefault(i, []).append(runner.canary.cpu().clone())
        words = record_words(runner.canary).cpu()
        assert words[0].tolist() == [0, 0, 0, 0]  # padding writes to slot 0 are never stamped
        for req in requests:  # every cached token's record holds the chain of its request's tokens
            want = [to_signed(c) for c in chain_values(req.tokens[: req.cached])]
            assert_same(f"chain of row {req.row}", words[req.slots, CHAIN], want)
        # a final sweep over every request's whole sequence, fingerprints included
        rpi = runner.t([r.row for r in requests])
        lens = runner.t([r.cached for r in requests])
        plan = build_plan(req_pool_indices=rpi, prefix_lens=lens, extend_lens=torch.zeros_like(lens),
                          req_to_token=runner.req_to_token, plan=runner.plan, truth=runner.truth,
                          truth_lens=runner.t([len(r.tokens) for r in requests]), backend=backend)
        with_state(verify, canary=runner.canary, plan=plan, ring=runner.ring, ring_counter=runner.counter,
                   stats=runner.stats, tag=LaunchTag(LaunchPoint.SWEEP).value, sources=runner.sources, mode=mode,
                   backend=backend)
        assert runner.counter.tolist() == [0]
        stats = runner.stats.cpu()
        assert stats[HEAD, STAT_LAUNCHES].item() == len(steps) == stats[TAIL, STAT_LAUNCHES].item()
        assert stats[HEAD, STAT_STAMPED].item() == sum(r.cached for r in requests) - 12 - 9
        assert stats[HEAD, STAT_CHECKED].item() == stats[TAIL, STAT_CHECKED].item() > 0
        canaries.setdefault("stats", []).append(stats)
    for key, (a, b) in canaries.items():
        assert_same(f"canary after step {key}" if key != "stats" else "stats", a, b)
