"""mark_writes / check_writes_landed: HEAD marks every write target, TAIL names those the forward
did not write.

The torch path and the Triton kernel (interpreted on CPU) must give the reference's source bytes,
ring rows and ``landed`` flags, byte for byte, on random paged sources (with and without a page
stride wider than the page), random targets (padding, out of the pool, duplicates, through a
window table) and a forward that writes random bytes into most targets and drops some writes in
some sources; the twin in which every write lands reports nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.core.record import Half, Reason, new_ring
from kvcanary.ops import check_writes_landed, mark_writes
from kvcanary.ops._common import Backend
from kvcanary.ops.bound import BoundMarks
from kvcanary.ops.fingerprint import KVSource

from . import reference as ref
from ._compare import assert_same
from ._helpers import BACKENDS, SEEDS, assert_ring, device_for, on_device, random_canary, token_ids, with_state

TAIL = 4


def make_sources(gen: torch.Generator, num_slots: int, count: int) -> list[KVSource]:
    out = []
    for i in range(count):
        page = int(torch.randint(1, 4, (1,), generator=gen))
        bpt = 16 * int(torch.randint(1, 4, (1,), generator=gen))
        pad = 16 * int(torch.randint(0, 3, (1,), generator=gen))  # bytes after each page (a strided layout)
        pages = -(-num_slots // page)
        buf = torch.randint(0, 256, (pages * (page * bpt + pad),), dtype=torch.uint8, generator=gen)
        out.append(KVSource(buf.view(torch.int32), num_slots, bpt, page, page * bpt + pad, Half(i % 2), i // 2))
    return out


def make_case(gen: torch.Generator, n: int, num_sources: int, lut: bool, drop: float) -> dict:
    num_slots = n + 3 + int(torch.randint(0, 6, (1,), generator=gen))
    loc = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    wild = torch.tensor([0, -4, num_slots, num_slots + 9])
    hit = torch.rand(n, generator=gen) < 0.15
    loc = torch.where(hit, wild[torch.randint(0, 4, (n,), generator=gen)], loc)
    if n > 2:
        loc[1] = loc[2]  # a duplicate target: both lanes mark the same bytes
    table = torch.arange(num_slots)
    table[1:] = torch.randperm(num_slots - 1, generator=gen) + 1
    ring, counter = new_ring(2 * n + 2)
    counter += int(torch.randint(0, 3, (1,), generator=gen))
    return dict(canary=random_canary(gen, num_slots), out_cache_loc=loc.to(torch.int64),
                input_ids=token_ids(gen, n), positions=torch.randint(0, 5000, (n,), generator=gen),
                sources=make_sources(gen, num_slots, num_sources), lut=table if lut else None, ring=ring,
                ring_counter=counter, drop=drop)


def forward_writes(gen: torch.Generator, case: dict, marked: list[list[int]]) -> list[list[int]]:
    """The sources' words after a forward that writes random bytes into the first 16 bytes of each
    target's row in each source, except where a drop hits (the mark stays)."""
    num_slots = case["canary"].shape[0]
    lut = case["lut"].tolist() if case["lut"] is not None else None
    out = [list(w) for w in marked]
    for loc in case["out_cache_loc"].tolist():
        slot = ref.translate(loc, lut) if lut is not None else loc
        if not 0 < slot < num_slots:
            continue
        for words, src in zip(out, case["sources"], strict=True):
            if float(torch.rand(1, generator=gen)) < case["drop"]:
                continue
            start = ((slot // src.page_size) * src.page_stride + (slot % src.page_size) * src.bytes_per_token) // 4
            words[start: start + 4] = torch.randint(-(2**31), 2**31 - 1, (4,), generator=gen).tolist()
    return out


def run(case: dict, backend: Backend, forward: list[list[int]] | None = None):
    """mark_writes, then (the forward's words put in place) check_writes_landed on ``backend``."""
    dev = device_for(backend)
    args = {k: on_device(v, dev) for k, v in case.items() if k != "drop"}
    with_state(mark_writes, canary=args["canary"], out_cache_loc=args["out_cache_loc"], sources=args["sources"],
               lut=args["lut"], backend=backend)
    marked = [s.words.cpu().tolist() for s in args["sources"]]
    if forward is None:
        return marked, None, None
    for src, words in zip(args["sources"], forward, strict=True):
        src.words.copy_(torch.tensor(words, dtype=torch.int32))
    landed = with_state(check_writes_landed, canary=args["canary"], ring=args["ring"],
                        ring_counter=args["ring_counter"], out_cache_loc=args["out_cache_loc"],
                        input_ids=args["input_ids"], positions=args["positions"], sources=args["sources"],
                        tag=TAIL, lut=args["lut"], backend=backend)
    return marked, landed, args


def expected(gen: torch.Generator, case: dict) -> tuple[list, list, list[list[int]], list]:
    """The reference's marks, the forward's writes over them (some dropped, as the case says), and
    the rows and landed flags of the check that follows."""
    num_slots = case["canary"].shape[0]
    lut = case["lut"].tolist() if case["lut"] is not None else None
    ref_sources = [ref.RefSource.of(s) for s in case["sources"]]
    want_marked = ref.mark_writes(ref_sources, case["out_cache_loc"].tolist(), num_slots, lut)
    forward = forward_writes(gen, case, want_marked)
    after = [ref.RefSource(w, s.page_size, s.page_stride_bytes, s.bytes_per_token)
             for w, s in zip(forward, ref_sources, strict=True)]
    rows, landed = ref.check_writes_landed(after, [int(s.half) for s in case["sources"]],
                                           case["out_cache_loc"].tolist(), case["input_ids"].tolist(),
                                           case["positions"].tolist(), num_slots, TAIL, lut)
    return want_marked, forward, rows, landed


def assert_run(case: dict, backend: Backend, forward: list, want_marked: list, landed: list,
               rows: list[list[int]]) -> dict:
    """Marks and check on ``backend``: the reference's marks, landed flags and rows; returns the
    arguments after the run."""
    marked, got_landed, args = run(case, backend, forward)
    for i, (got, want) in enumerate(zip(marked, want_marked, strict=True)):
        assert_same(f"source {i} marked [{backend.value}]", got, want)
    assert_same(f"landed [{backend.value}]", got_landed, landed)
    assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], case["ring"],
                int(case["ring_counter"]), rows)
    return args


def check_case(gen: torch.Generator, case: dict) -> list[list[int]]:
    want_marked, forward, rows, landed = expected(gen, case)
    for backend in BACKENDS:
        args = assert_run(case, backend, forward, want_marked, landed, rows)
        for i, (src, want) in enumerate(zip(args["sources"], forward, strict=True)):
            assert_same(f"source {i} after the check [{backend.value}]", src.words, want)  # the check only reads
    return rows


@settings(max_examples=10)
@given(seed=SEEDS, n=st.integers(0, 300), num_sources=st.integers(1, 4), lut=st.booleans(),
       drop=st.sampled_from([0.0, 0.05, 0.5]))
def test_matches_the_reference(seed, n, num_sources, lut, drop):
    gen = torch.Generator().manual_seed(seed)
    rows = check_case(gen, make_case(gen, n, num_sources, lut, drop))
    if drop == 0.0:
        assert rows == []


def test_dropped_write_is_named_with_its_sources_and_half():
    """One target's write lands in source 0 but not in source 1 (a V half): one row, bit 1, half V."""
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, 6, 2, lut=False, drop=0.0)
    case["out_cache_loc"] = torch.tensor([3, 4, 5, 6, 7, 8])
    ref_sources = [ref.RefSource.of(s) for s in case["sources"]]
    marked = ref.mark_writes(ref_sources, case["out_cache_loc"].tolist(), case["canary"].shape[0])
    forward = forward_writes(gen, case, marked)
    src = case["sources"][1]
    start = ((5 // src.page_size) * src.page_stride + (5 % src.page_size) * src.bytes_per_token) // 4
    forward[1][start: start + 4] = ref.mark(5)  # the write of slot 5 into source 1 did not happen
    for backend in BACKENDS:
        _, landed, args = run(case, backend, forward)
        assert landed.tolist() == [True, True, False, True, True, True]
        want = [[TAIL | int(Half.V), 5, int(case["positions"][2]), int(case["input_ids"][2]), -1, 2, 0,
                 int(Reason.MISSED_WRITE)]]
        assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], case["ring"],
                    int(case["ring_counter"]), want)


def test_no_sources_marks_and_checks_nothing():
    gen = torch.Generator().manual_seed(6)
    case = make_case(gen, 5, 1, lut=False, drop=0.0)
    for backend in BACKENDS:
        dev = device_for(backend)
        canary, loc = on_device(case["canary"], dev), on_device(case["out_cache_loc"], dev)
        with_state(mark_writes, canary=canary, out_cache_loc=loc, sources=[], backend=backend)
        landed = with_state(check_writes_landed, canary=canary, out_cache_loc=loc, input_ids=loc, positions=loc,
                            sources=[], tag=TAIL, backend=backend)
        assert landed.tolist() == [True] * 5


@pytest.mark.parametrize(("change", "exc", "fragment"), [
    (dict(out_cache_loc=torch.zeros(3, dtype=torch.int32)), TypeError, "out_cache_loc dtype int32 != int64"),
    (dict(positions=torch.zeros(2, dtype=torch.int64)), ValueError, "positions length 2 != len(out_cache_loc) (3)"),
    (dict(sources=["x"]), TypeError, "sources[0] must be a KVSource"),
    (dict(sources=None), TypeError, "sources must be a list of KVSource"),
    (dict(tag=99), ValueError, "tag 99 out of range"),
    (dict(out=torch.zeros(2, dtype=torch.bool)), ValueError, "out length 2 != len(out_cache_loc) (3)"),
    (dict(lut=torch.zeros(3, dtype=torch.int32)), TypeError, "lut dtype int32 != int64"),
])
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
def test_validation_errors_before_anything_is_written(change, exc, fragment, backend):
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, 3, 2, lut=False, drop=0.0)
    args = dict(canary=case["canary"], ring=case["ring"], ring_counter=case["ring_counter"],
                out_cache_loc=case["out_cache_loc"], input_ids=case["input_ids"], positions=case["positions"],
                sources=case["sources"], tag=TAIL) | change
    before = [s.words.clone() for s in case["sources"]]
    count = int(case["ring_counter"][0])
    with pytest.raises(exc) as info:
        with_state(check_writes_landed, **args, backend=backend)
    assert fragment in str(info.value)
    if "tag" not in change and "positions" not in change and "out" not in change:
        mark_args = {k: args[k] for k in ("canary", "out_cache_loc", "sources")} | \
            {k: v for k, v in change.items() if k == "lut"}
        with pytest.raises(exc):
            with_state(mark_writes, **mark_args, backend=backend)
    for src, words in zip(case["sources"], before, strict=True):
        assert torch.equal(src.words, words)
    assert int(case["ring_counter"][0]) == count


@settings(max_examples=6)
@given(seed=SEEDS, n=st.integers(0, 200), num_sources=st.integers(1, 4), lut=st.booleans())
def test_bound_marks_write_the_references_marks(seed, n, num_sources, lut):
    """BoundMarks (the sources checked once) marks what the reference marks; a target of another
    dtype or layout is refused with nothing written."""
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, n, num_sources, lut, 0.0)
    want = ref.mark_writes([ref.RefSource.of(s) for s in case["sources"]], case["out_cache_loc"].tolist(),
                           case["canary"].shape[0], case["lut"].tolist() if lut else None)
    dev = device_for(Backend.TRITON)
    args = {k: on_device(v, dev) for k, v in case.items() if k != "drop"}
    bound = with_state(lambda state: BoundMarks(state, args["sources"]), canary=args["canary"])
    before = [s.words.clone() for s in args["sources"]]
    assert not bound(args["out_cache_loc"].to(torch.int32), args["lut"])
    wide = torch.zeros(2 * n, dtype=torch.int64, device=dev)
    assert not bound(wide[::2], args["lut"]) or n <= 1  # a strided view of n > 1 elements
    for i, (src, was) in enumerate(zip(args["sources"], before, strict=True)):
        assert_same(f"source {i} after refused calls", src.words, was)
    assert bound(args["out_cache_loc"], args["lut"])
    for i, (src, words) in enumerate(zip(args["sources"], want, strict=True)):
        assert_same(f"source {i} marked [bound]", src.words, words)


@pytest.mark.parametrize("backend", [Backend.TORCH, Backend.TRITON, Backend.AUTO], ids=["torch", "triton", "auto"])
def test_the_path_asked_for_is_the_one_that_runs(backend, monkeypatch):
    """The Triton kernels run where asked for (or AUTO on CUDA), the torch path elsewhere (AUTO on
    the host included): each path counted by a wrapper, the marks and rows still the reference's.
    On a GPU the torch path's boolean indexing would not capture; on a host without the
    interpreter the kernels would not run at all."""
    from kvcanary.ops import landed

    calls = {"launch": 0, "mark_torch": 0, "landed_torch": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(landed, "launch", counted("launch", landed.launch))
    monkeypatch.setattr(landed, "_mark_writes_torch", counted("mark_torch", landed._mark_writes_torch))
    monkeypatch.setattr(landed, "_landed_torch", counted("landed_torch", landed._landed_torch))
    gen = torch.Generator().manual_seed(8)
    case = make_case(gen, 37, 3, lut=True, drop=0.3)
    want_marked, forward, rows, landed_want = expected(gen, case)
    assert rows  # some writes were dropped
    assert_run(case, backend, forward, want_marked, landed_want, rows)
    triton = backend is Backend.TRITON
    assert calls == {"launch": int(triton), "mark_torch": int(not triton), "landed_torch": int(not triton)}
