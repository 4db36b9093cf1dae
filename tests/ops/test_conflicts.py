"""check_writes: duplicate write targets and writes into read / held slots, found at HEAD.

The torch path and the Triton kernel (interpreted on CPU) must give the reference's ring rows,
byte for byte, on random batches whose writes collide with each other, with prefixes the batch
reads, and with held prefix-cache slots; the clean twins report nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.core.record import Reason, new_ring, new_stats
from kvcanary.ops._common import Backend
from kvcanary.ops.conflicts import WriteMarks, check_writes
from kvcanary.ops.plan import Plan, build_plan

from . import reference as ref
from ._helpers import BACKEND_IDS, BACKENDS, SEEDS, device_for, plan_lists, ring_rows, token_ids, with_state

HEAD = 0


def make_batch(gen: torch.Generator, prefix: list[int], extend: list[int], *, collide: float, lut: bool,
               held: int) -> dict:
    """Requests with distinct prefix and write slots; then some writes are repointed at other
    writes' slots, at read slots, at held slots, at slot 0 or outside the pool."""
    bs = len(prefix)
    need = sum(prefix) + sum(extend) + held
    num_slots = need + 3 + int(torch.randint(0, 4, (1,), generator=gen))
    max_ctx = max([p + e for p, e in zip(prefix, extend, strict=True)], default=0) + 1
    free = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    rtt = torch.zeros(bs + 1, max_ctx, dtype=torch.int32)
    loc = []
    for r in range(bs):
        n, e = prefix[r], extend[r]
        slots, free = free[: n + e], free[n + e:]
        rtt[r + 1, : n + e] = torch.tensor(slots, dtype=torch.int32)
        loc += slots[n:]
    held_slots, free = free[:held], free[held:]
    table = torch.arange(num_slots)
    if lut:
        table[1:] = torch.randperm(num_slots - 1, generator=gen) + 1
    rpi = torch.arange(1, bs + 1)
    rpi[torch.rand(bs, generator=gen) < 0.15] = 0  # padding requests: their lanes still count
    read = [int(s) for r in range(bs) for s in rtt[r + 1, : prefix[r]].tolist()]
    pool = loc + read + held_slots + [0, -2, num_slots]
    loc_t = torch.tensor(loc, dtype=torch.int64)
    if loc and pool:
        hit = torch.rand(len(loc), generator=gen) < collide
        pick = torch.tensor(pool, dtype=torch.int64)[torch.randint(0, len(pool), (len(loc),), generator=gen)]
        loc_t = torch.where(hit, pick, loc_t)
    n = len(loc)
    ring, counter = new_ring(n + 3)
    counter += int(torch.randint(0, 3, (1,), generator=gen))
    plan = build_plan(req_pool_indices=rpi, prefix_lens=torch.tensor(prefix, dtype=torch.int64),
                      extend_lens=torch.tensor(extend, dtype=torch.int64), req_to_token=rtt,
                      plan=Plan.allocate(max(sum(prefix), 1), max(bs, 1)), lut=table if lut else None)
    held_t = table[torch.tensor(held_slots, dtype=torch.int64)] if held else None  # pool slots, like the reads
    return dict(plan=plan, out_cache_loc=loc_t, input_ids=token_ids(gen, n), positions=torch.randint(0, 99, (n,)),
                req_pool_indices=rpi, write_offsets=plan.write_offsets[: bs + 1].clone(),
                canary=torch.zeros(num_slots, 32, dtype=torch.uint8), marks=WriteMarks.allocate(num_slots), ring=ring,
                ring_counter=counter, stats=new_stats(), tag=HEAD, lut=table if lut else None, held=held_t)


def expected_rows(b: dict) -> list[list[int]]:
    lut = b["lut"].tolist() if b["lut"] is not None else None
    held = b["held"].tolist() if b["held"] is not None else None
    return ref.check_writes(plan_lists(b["plan"]), b["out_cache_loc"].tolist(), b["input_ids"].tolist(),
                            b["positions"].tolist(), b["req_pool_indices"].tolist(), b["write_offsets"].tolist(),
                            b["canary"].shape[0], b["tag"], lut, held)


def run_backend(b: dict, backend: Backend, launches: int = 1) -> list[list[int]]:
    dev = device_for(backend)
    args = {k: (v.to(dev, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    args["plan"] = Plan(**{k: v.to(dev, copy=True) for k, v in vars(b["plan"]).items()})
    args["marks"] = WriteMarks(b["marks"].words.to(dev, copy=True), b["marks"].epoch.to(dev, copy=True))
    base = int(b["ring_counter"][0])
    for _ in range(launches):  # marks of earlier launches must not leak into later ones
        args["ring"].fill_(-1)
        args["ring_counter"].fill_(base)
        with_state(check_writes, **args, backend=backend)
    rows = [r for r in ring_rows(args["ring"], args["ring_counter"]) if r[0] != -1]  # rows before base: unset
    assert int(args["ring_counter"][0]) == base + len(rows)
    return rows


def assert_all_backends(b: dict, launches: int = 1) -> list[list[int]]:
    want = sorted(expected_rows(b))
    for backend in BACKENDS:
        assert run_backend(b, backend, launches) == want, backend
    return want


@settings(max_examples=25, deadline=None)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6)), min_size=0, max_size=6),
       collide=st.sampled_from([0.0, 0.3, 1.0]), lut=st.booleans(), held=st.integers(0, 3))
def test_matches_reference(seed, lens, collide, lut, held):
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(gen, [p for p, _ in lens], [e for _, e in lens], collide=collide, lut=lut, held=held)
    want = assert_all_backends(b, launches=2)
    if collide == 0.0:
        assert want == []  # the clean twin: distinct targets, none read or held


def fixed_batch(loc: list[int], held=None) -> dict:
    """Request A (row 1) reads slots 3, 4 and writes 2 tokens; B (row 2) reads 5 and writes 2."""
    rtt = torch.zeros(3, 8, dtype=torch.int32)
    rtt[1, :4] = torch.tensor([3, 4, 10, 11], dtype=torch.int32)
    rtt[2, :3] = torch.tensor([5, 12, 13], dtype=torch.int32)
    rpi = torch.tensor([1, 2])
    plan = build_plan(req_pool_indices=rpi, prefix_lens=torch.tensor([2, 1]), extend_lens=torch.tensor([2, 2]),
                      req_to_token=rtt, plan=Plan.allocate(8, 2))
    ring, counter = new_ring(8)
    return dict(plan=plan, out_cache_loc=torch.tensor(loc), input_ids=torch.tensor([71, 72, 73, 74]),
                positions=torch.tensor([2, 3, 1, 2]), req_pool_indices=rpi,
                write_offsets=plan.write_offsets[:3].clone(),
                canary=torch.zeros(16, 32, dtype=torch.uint8), marks=WriteMarks.allocate(16), ring=ring,
                ring_counter=counter, stats=new_stats(), tag=HEAD,
                held=None if held is None else torch.tensor(held))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_named_conflicts(backend):
    assert run_backend(fixed_batch([10, 11, 12, 13]), backend) == []  # the clean twin
    # B's first token lands on A's second target: a duplicate naming B (row 2) and A (row 1)
    assert run_backend(fixed_batch([10, 11, 11, 13]), backend) == [
        [HEAD, 11, 1, 73, -1, 2, 1, int(Reason.WRITE_CONFLICT)]]
    # A writes slot 5, which B reads: a read conflict naming A (row 1) and the reader B (row 2)
    assert run_backend(fixed_batch([10, 5, 12, 13]), backend) == [[HEAD, 5, 3, 72, -1, 1, 2, int(Reason.READ_CONFLICT)]]
    # B writes a slot the prefix cache holds idle: the reader is row 0 (the cache)
    assert run_backend(fixed_batch([10, 11, 12, 14], held=[14, 15]), backend) == [
        [HEAD, 14, 2, 74, -1, 2, 0, int(Reason.READ_CONFLICT)]]
    # slot 0 and out-of-pool targets are no conflicts (stamp names them as bad entries)
    assert run_backend(fixed_batch([0, 0, 99, 99]), backend) == []


@pytest.mark.parametrize(("change", "fragment"), [
    (dict(marks=WriteMarks.allocate(15)), "marks cover 15 slots on cpu but the state has 16"),
    (dict(marks="x"), "marks must be a WriteMarks"),
    (dict(held=torch.tensor([1.0])), "held"),
    (dict(out_cache_loc=torch.tensor([10, 11, 12])), "out_cache_loc length 3 != len(input_ids) (4)"),
    (dict(tag=99), "tag 99 out of range"),
])
def test_validation_errors(change, fragment):
    with pytest.raises(ValueError) as info:
        with_state(check_writes, **(fixed_batch([10, 11, 12, 13]) | change), backend=Backend.TORCH)
    assert fragment in str(info.value)


def test_marks_refuse_bad_buffers():
    with pytest.raises(ValueError, match="WriteMarks.words must be a contiguous int64"):
        WriteMarks(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_slots 1 < 2"):
        WriteMarks.allocate(1)
