"""check_forward: HEAD and TAIL in one launch agree with the sequence of ops they replace.

The pure-Python reference is that sequence (build_plan -> verify -> gather -> stamp for HEAD;
build_plan -> verify with fingerprints -> fingerprint(record) for TAIL); the torch path and the
Triton kernel (interpreted on CPU) must both give its canary bytes, ring rows, counter and stats,
on random pools with damaged records, wild page-table entries, skewed positions, wrong tokens, a
sliding-window LUT and writes that span several 1024-token blocks (the look-back)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.core.hashing import chain_values, to_signed
from kvcanary.core.record import (
    STAT_CHECKED,
    STAT_LAUNCHES,
    STAT_STAMPED,
    Half,
    Reason,
    new_ring,
    new_stats,
    record_words,
)
from kvcanary.ops._common import Backend
from kvcanary.ops.check import Workspace, check_forward
from kvcanary.ops.check_launch import verify_split
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceState
from kvcanary.runtime.eager_graphs import EagerBuffers

from . import reference as ref
from ._compare import assert_same
from ._helpers import (
    SEEDS,
    WITH_NUMBA,
    assert_ring,
    damage_sources,
    device_for,
    plan_lists,
    random_canary,
    random_tags,
    run_op,
    token_ids,
    with_state,
    words_of,
)

MODES = [FingerprintMode.NONE, FingerprintMode.PARTIAL, FingerprintMode.ALL]


def make_world(gen: torch.Generator, prefix: list[int], extend: list[int], *, mode: FingerprintMode,
               with_truth: bool, corrupt: float, lut: bool, window: int, stamp: bool, tag: int) -> dict:
    """Requests with clean stamped prefixes in random slots, writes into other free slots, then damage."""
    bs = len(prefix)
    need = sum(prefix) + sum(extend)
    num_slots = need + 5 + int(torch.randint(0, 5, (1,), generator=gen))
    max_ctx = max([p + e for p, e in zip(prefix, extend, strict=True)], default=0) + 2
    canary = random_canary(gen, num_slots)
    words = record_words(canary)
    aux = torch.Generator().manual_seed(gen.initial_seed() + 1)  # side words, halves, K/V damage: gen's draws stay
    tags = random_tags(aux, num_slots)
    sources = []
    if mode is not FingerprintMode.NONE:
        page = int(torch.randint(1, 4, (1,), generator=gen))
        pages = -(-num_slots // page)
        sources = [KVSource.from_buffer(torch.randint(0, 256, (pages, page, 48), dtype=torch.uint8,
                                                      generator=gen if i < 2 else aux),
                                        page_size=page, half=Half(int(torch.randint(0, 2, (1,), generator=aux))),
                                        layer=i) for i in range(2 + int(torch.randint(0, 3, (1,), generator=aux)))]
    ref_sources = [ref.RefSource.of(s) for s in sources]
    # the pool slot of page-table slot s: identity, or a permutation through a LUT (0 stays 0)
    table = torch.arange(num_slots)
    if lut:
        table[1:] = torch.randperm(num_slots - 1, generator=gen) + 1
    # slot 1 holds no request's K/V: a damaged page-table entry may point at it (see below), and a
    # seed inside this forward's own writes would race with them (unspecified, as for ``stamp``)
    free = (torch.randperm(num_slots - 2, generator=gen) + 2).tolist()
    rtt = torch.zeros(bs + 1, max_ctx, dtype=torch.int32)
    truth = torch.zeros(bs + 1, max_ctx, dtype=torch.int32)
    ids, pos, loc, truth_lens = [], [], [], []
    for r in range(bs):
        n, e = prefix[r], extend[r]
        tokens = token_ids(gen, n + e, -(2**31), 2**31 - 1).tolist()
        slots, free = free[: n + e], free[n + e:]
        rtt[r + 1, : n + e] = torch.tensor(slots, dtype=torch.int32)
        truth[r + 1, : n + e] = torch.tensor(tokens, dtype=torch.int32)
        truth_lens.append(n + e - int(torch.randint(0, 2, (1,), generator=gen)))
        for p, (s, c) in enumerate(zip(slots[:n], chain_values(tokens[:n]), strict=True)):
            pool_slot = int(table[s])
            if sources:
                fp, tags[pool_slot] = ref.fingerprint_parts(pool_slot, ref_sources, mode)
            else:
                fp = 0
            words[pool_slot] = torch.tensor([tokens[p], p, to_signed(c), fp])
        ids += tokens[n:]
        pos += list(range(n, n + e))
        loc += slots[n:]
    rpi = torch.arange(1, bs + 1)
    rpi[torch.rand(bs, generator=gen) < 0.15] = 0  # padding requests
    ids_t, pos_t, loc_t = (torch.tensor(x, dtype=torch.int64) for x in (ids, pos, loc))
    # damage: record words, page-table entries (wild, padding, another slot), positions, written tokens
    bad = torch.rand(num_slots, generator=gen) < corrupt
    col = torch.randint(0, 4, (num_slots,), generator=gen)
    words[bad, col[bad]] += torch.randint(1, 3, (int(bad.sum()),), generator=gen)
    damage_sources(aux, sources, num_slots, corrupt)
    hit = torch.rand(rtt.shape, generator=gen) < corrupt / 4
    wild = torch.tensor([0, -3, num_slots, num_slots + 7, 1], dtype=torch.int32)
    rtt = torch.where(hit, wild[torch.randint(0, 5, rtt.shape, generator=gen)], rtt)
    if len(ids):
        pos_t += (torch.rand(len(pos), generator=gen) < corrupt / 4).to(torch.int64)
        ids_t += (torch.rand(len(ids), generator=gen) < corrupt / 4).to(torch.int64)
        # write conflicts: a write into a prefix slot some request reads (never a seed: that races,
        # as for ``stamp``), and prefix-cache-held slots that include some write targets
        # no request's seed either: page-table damage can put one request's seed inside another's prefix
        seeds = {int(rtt[r + 1, prefix[r] - 1]) for r in range(bs) if prefix[r] > 0}
        inner = [int(s) for r in range(bs) for s in rtt[r + 1, : max(prefix[r] - 1, 0)].tolist()
                 if s > 1 and int(s) not in seeds]
        if inner:
            # each picked slot written once (two writes of one slot race on a GPU: which record
            # survives is unspecified; test_duplicate_write_targets_are_named_at_head covers them)
            hit_w = (torch.rand(len(loc), generator=gen) < corrupt / 4).tolist()
            order = torch.randperm(len(inner), generator=gen).tolist()
            used = {int(x) for x in loc_t.tolist()}
            for t, hit in enumerate(hit_w):
                while hit and order:
                    cand = inner[order.pop()]
                    if cand not in used:
                        used.add(cand)
                        loc_t[t] = cand
                        break
    held = [int(table[s]) for s in loc_t.tolist()
            if 0 < s < num_slots and float(torch.rand(1, generator=gen)) < corrupt]
    held += [int(table[s]) for s in free[:2]]
    # writes that did not happen: at TAIL, some targets still hold HEAD's mark in some source
    if sources and not stamp:
        for loc in loc_t.tolist():
            slot = int(table[loc]) if 0 <= loc < num_slots else -1
            for src in sources:
                if 0 < slot < num_slots and float(torch.rand(1, generator=gen)) < corrupt:
                    start = ((slot // src.page_size) * src.page_stride + (slot % src.page_size) * src.bytes_per_token)
                    src.words[start // 4: start // 4 + 4] = torch.tensor(ref.mark(slot), dtype=torch.int32)
    ring, counter = new_ring(sum(prefix) + 3 * len(ids) + 3)
    counter += int(torch.randint(0, 3, (1,), generator=gen))
    stats = torch.randint(0, 50, new_stats().shape, generator=gen)
    return dict(canary=canary, req_pool_indices=rpi, prefix_lens=torch.tensor(prefix, dtype=torch.int64),
                extend_lens=torch.tensor(extend, dtype=torch.int64), req_to_token=rtt, input_ids=ids_t,
                positions=pos_t, out_cache_loc=loc_t, ring=ring, ring_counter=counter, stats=stats, tag=tag,
                stamp=stamp, truth=truth if with_truth else None,
                truth_lens=torch.tensor(truth_lens, dtype=torch.int64) if with_truth else None,
                sources=sources, mode=mode, lut=table if lut else None, window=window,
                held=torch.tensor(held, dtype=torch.int64), source_tags=tags)


def expected(w: dict):
    """(records, side words, ring rows, checked, stamped, source words) of the sequence of reference ops."""
    bs = w["req_pool_indices"].shape[0]
    rpi, prefix, extend = w["req_pool_indices"].tolist(), w["prefix_lens"].tolist(), w["extend_lens"].tolist()
    rtt, max_ctx = w["req_to_token"].tolist(), w["req_to_token"].shape[1]
    truth = w["truth"].tolist() if w["truth"] is not None else None
    tlens = w["truth_lens"].tolist() if w["truth_lens"] is not None else None
    lut = w["lut"].tolist() if w["lut"] is not None else None
    entries = sum(min(max(p, 0), max_ctx) - (max(min(p, max_ctx) - w["window"], 0) if w["window"] else 0)
                  for p, row in zip(prefix, rpi, strict=True) if 1 <= row < len(rtt))
    plan = ref.build_plan(rpi, prefix, extend, rtt, max_ctx, plan_lists(Plan.allocate(max(entries, 1), max(bs, 1))),
                          truth, max_ctx, tlens, lut, w["window"])
    sources = [ref.RefSource.of(s) for s in w["sources"]]
    words, tags = words_of(w["canary"]), w["source_tags"].tolist()
    rows, checked = ref.verify(words, plan, w["tag"], [] if w["stamp"] else sources, w["mode"], tags)
    ids, pos, loc = w["input_ids"].tolist(), w["positions"].tolist(), w["out_cache_loc"].tolist()
    stamped = 0
    if w["stamp"]:
        rows += ref.check_writes(plan, loc, ids, pos, rpi, plan["write_offsets"][: bs + 1], len(words), w["tag"], lut,
                                 w["held"].tolist())
        exp = None
        if truth is not None:
            exp = ref.gather_expected_tokens(truth, max_ctx, tlens, rpi, prefix, plan["write_offsets"][: bs + 1], ids)
        words, stamp_rows, stamped = ref.stamp(words, loc, ids, pos, rpi, prefix, plan["write_offsets"][: bs + 1],
                                               plan["seed"][:bs], w["tag"], exp, lut)
        rows += stamp_rows
        source_words = ref.mark_writes(sources, loc, len(words), lut)
        return words, tags, rows, checked, stamped, source_words
    source_words = [s.words for s in sources]
    if sources:
        missed, landed = ref.check_writes_landed(sources, [int(s.half) for s in w["sources"]], loc, ids, pos,
                                                 len(words), w["tag"], lut)
        rows += missed
        slots = [ref.translate(s, lut) if ok else 0 for s, ok in zip(loc, landed, strict=True)]
        _, words, tags = ref.fingerprint(slots, sources, w["mode"], words, True, tags)
    return words, tags, rows, checked, stamped, source_words


def check_all(w: dict, split: int | None = None) -> list[list[int]]:
    words, tags, rows, checked, stamped, source_words = expected(w)
    want_stats = w["stats"].clone()
    want_stats[w["tag"], STAT_LAUNCHES] += 1
    want_stats[w["tag"], STAT_CHECKED] += checked
    want_stats[w["tag"], STAT_STAMPED] += stamped
    for backend in WITH_NUMBA:
        args, _ = run_op(check_forward, backend, **w, split=split)
        assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], w["ring"], int(w["ring_counter"]),
                    rows)
        assert_same(f"stats [{backend.value}]", args["stats"], want_stats)
        assert_same(f"canary [{backend.value}]", words_of(args["canary"]), words)
        assert_same(f"side words [{backend.value}]", args["source_tags"], tags)
        for i, (src, want) in enumerate(zip(args["sources"], source_words, strict=True)):
            assert_same(f"source {i} [{backend.value}]", src.words, want)
    return rows


@settings(max_examples=8)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5)), max_size=5),
       mode=st.sampled_from(MODES), with_truth=st.booleans(), corrupt=st.sampled_from([0.0, 0.1, 0.3]),
       lut=st.booleans(), window=st.sampled_from([0, 0, 7]), stamp=st.booleans(), tag=st.integers(0, 11),
       split=st.sampled_from([None, 1, 3]))
def test_matches_the_sequence_of_ops(seed, lens, mode, with_truth, corrupt, lut, window, stamp, tag, split):
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=mode, with_truth=with_truth,
                   corrupt=corrupt, lut=lut, window=window, stamp=stamp, tag=tag)
    rows = check_all(w, split)
    if corrupt == 0.0:
        assert rows == []


@settings(max_examples=8)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), min_size=1, max_size=4),
       lut=st.booleans(), stamp=st.booleans(), count=st.sampled_from(["exact", "beyond", "negative", "zero"]))
def test_counted_held_slots_are_the_slots_they_count_and_head_consumes_them(seed, lens, lut, stamp, count):
    """``held_words`` (the count, then the slots): HEAD checks the first ``count`` slots as
    ``held`` does, the count clamped to [0, capacity], and sets the count to 0; TAIL leaves the
    words alone. The words after the count are write targets: a kernel reading past the count
    would report them. Every backend against the reference's rows."""
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=FingerprintMode.PARTIAL, with_truth=True,
                   corrupt=0.3, lut=lut, window=0, stamp=stamp, tag=5)
    held = w.pop("held").tolist()
    table = w["lut"].tolist() if lut else None
    targets = [ref.translate(s, table) for s in w["out_cache_loc"].tolist()]
    beyond = [s for s in targets if 0 < s < w["canary"].shape[0] and s not in held][:3]
    value = {"exact": len(held), "beyond": len(held) + len(beyond) + 4, "negative": -3, "zero": 0}[count]
    words = torch.tensor([value, *held, *beyond], dtype=torch.int64)
    counted = (held + beyond)[: max(0, min(value, len(held) + len(beyond)))]
    rows_want, checked = expected_rows(w | {"held": torch.tensor(counted, dtype=torch.int64)})
    for backend in WITH_NUMBA:
        args, _ = run_op(check_forward, backend, **w, held_words=words)
        assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], w["ring"], int(w["ring_counter"]),
                    rows_want)
        after = words.clone()
        if stamp:
            after[0] = 0
        assert_same(f"held_words [{backend.value}]", args["held_words"], after)
    if stamp and beyond and count == "exact":  # the slots past the count are written and not reported
        assert not any(r[1] in beyond and r[7] & Reason.READ_CONFLICT and r[6] == 0 for r in rows_want)


@settings(max_examples=8)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), min_size=1, max_size=4),
       mode=st.sampled_from(MODES), corrupt=st.sampled_from([0.0, 0.2]), stamp=st.booleans(),
       more=st.tuples(st.integers(1, 4), st.integers(0, 9)))
def test_a_padded_bucket_checks_as_the_batch_alone(seed, lens, mode, corrupt, stamp, more):
    """``runtime.eager_graphs``' padding on random worlds: the batch copied into buffers of more
    requests and tokens (row-0 requests, the first owning the padded tokens, which write slot 0),
    loaded after a full batch of junk, with junk truth lengths for the padded requests, leaves every
    byte as the batch alone: records, side words, source words, ring rows, counter and stats."""
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=mode, with_truth=True, corrupt=corrupt,
                   lut=False, window=0, stamp=stamp, tag=6)
    bs, n = w["req_pool_indices"].shape[0], w["input_ids"].shape[0]
    buffers = EagerBuffers(bs + more[0], n + more[1], None, False, "cpu")
    rows, slots, cap = w["req_to_token"].shape[0], w["canary"].shape[0], buffers.bs
    cuts = torch.sort(torch.randint(0, buffers.n + 1, (cap - 1,), generator=gen))[0]
    ends = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([buffers.n])])
    junk = lambda hi, k: torch.randint(0, hi, (k,), generator=gen)  # noqa: E731
    buffers.load(junk(rows, cap), junk(8, cap), ends[1:] - ends[:-1], junk(1000, buffers.n), junk(40, buffers.n),
                 junk(slots, buffers.n))
    buffers.load(w["req_pool_indices"], w["prefix_lens"], w["extend_lens"], w["input_ids"], w["positions"],
                 w["out_cache_loc"])
    padded = w | dict(req_pool_indices=buffers.rpi, prefix_lens=buffers.prefix, extend_lens=buffers.extend,
                      input_ids=buffers.ids, positions=buffers.pos, out_cache_loc=buffers.loc,
                      truth_lens=torch.cat([w["truth_lens"], junk(40, cap - bs)]))
    for backend in (Backend.TRITON, Backend.TORCH):
        runs = [run_op(check_forward, backend, **x)[0] for x in (w, padded)]
        ring = [sorted(a["ring"][: min(int(a["ring_counter"][0]), a["ring"].shape[0])].tolist()) for a in runs]
        assert ring[1] == ring[0], backend
        for name in ("canary", "source_tags", "ring_counter", "stats"):
            assert_same(f"{name} [{backend.value}]", runs[1][name], runs[0][name])
        for i, (got, want) in enumerate(zip(runs[1]["sources"], runs[0]["sources"], strict=True)):
            assert_same(f"source {i} [{backend.value}]", got.words, want.words)


def expected_rows(w: dict) -> tuple[list, int]:
    """The reference's ring rows and checked count for ``w``."""
    _, _, rows, checked, _, _ = expected(w)
    return rows, checked


@pytest.mark.parametrize("stamp", [True, False], ids=["head", "tail"])
def test_writes_spanning_blocks_continue_the_chain(stamp):
    """Segments that open in one 1024-token block and close blocks later: the look-back carries."""
    gen = torch.Generator().manual_seed(7)
    w = make_world(gen, [3, 0, 20, 5], [700, 1500, 3, 1100], mode=FingerprintMode.PARTIAL, with_truth=True,
                   corrupt=0.2, lut=False, window=0, stamp=stamp, tag=4)
    assert check_all(w, split=4)


def test_clean_long_prefill_then_decode_reports_nothing():
    """A clean 2500-token prefill stamped by the kernel verifies clean on the next HEAD."""
    gen = torch.Generator().manual_seed(8)
    w = make_world(gen, [0, 2], [2500, 1], mode=FingerprintMode.NONE, with_truth=True, corrupt=0.0, lut=False,
                   window=0, stamp=True, tag=0)
    w["req_pool_indices"] = torch.tensor([1, 2])
    args, _ = run_op(check_forward, Backend.TRITON, **w)
    assert int(args["ring_counter"][0]) == int(w["ring_counter"][0])
    dev = args["canary"].device
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    decode = dict(args, prefix_lens=torch.tensor([2500, 3], device=dev), extend_lens=torch.tensor([0, 0], device=dev),
                  input_ids=empty, positions=empty, out_cache_loc=empty, truth_lens=torch.tensor([2500, 3], device=dev))
    checked = int(decode["stats"][0, STAT_CHECKED])
    with_state(check_forward, **decode, backend=Backend.TRITON)
    assert int(decode["ring_counter"][0]) == int(w["ring_counter"][0])
    assert int(decode["stats"][0, STAT_CHECKED]) == checked + 2503


def test_one_workspace_serves_many_launches():
    """The sync words return to their rest state after every launch (only the epoch grows)."""
    gen = torch.Generator().manual_seed(9)
    dev = device_for(Backend.TRITON)
    ws = Workspace.allocate(8, 4096, dev)
    for k in range(3):
        w = make_world(gen, [5, 9, 2], [1, 1300, 4], mode=FingerprintMode.NONE, with_truth=False, corrupt=0.1,
                       lut=False, window=0, stamp=True, tag=0)
        words, _, rows, _, _, _ = expected(w)
        args, _ = run_op(check_forward, Backend.TRITON, **w, workspace=ws)
        assert_same("canary", words_of(args["canary"]), words)
        assert ws.sync.tolist() == [0, 0, 0, k + 1]


def test_the_launch_reads_its_sync_words_and_not_their_neighbours():
    """A workspace whose sync words lie inside a larger buffer, between words far past any count:
    the verifiers, the write blocks' wait and the reset read and write the four words alone."""
    gen = torch.Generator().manual_seed(10)
    dev = device_for(Backend.TRITON)
    spare = Workspace.allocate(8, 4096, dev)
    around = torch.full((6,), 2**62 + 5, dtype=torch.int64, device=dev)
    around[1:5] = 0
    ws = Workspace(around[1:5], spare.write_offsets, spare.seed, spare.block_sum, spare.block_flag)
    w = make_world(gen, [5, 9, 2], [1, 1300, 4], mode=FingerprintMode.PARTIAL, with_truth=True, corrupt=0.1,
                   lut=False, window=0, stamp=True, tag=3)
    words, _, rows, _, stamped, _ = expected(w)
    args, _ = run_op(check_forward, Backend.TRITON, **w, workspace=ws)
    assert stamped == 1304 and len(rows) == 224  # the reference's counts for this seed (its damage found)
    assert_same("canary", words_of(args["canary"]), words)
    assert_ring("ring", args["ring"], args["ring_counter"], w["ring"], int(w["ring_counter"]), rows)
    assert around.tolist() == [2**62 + 5, 0, 0, 0, 1, 2**62 + 5]


@pytest.mark.parametrize("lut", [False, True])
def test_duplicate_write_targets_are_named_at_head(lut):
    """Two tokens of one forward written to one slot: HEAD's fused check names the later writer
    and the first writer's row, as ``check_writes`` after the plan does (which record survives
    the race is unspecified, so only the rows are compared); its twin without the duplicate is
    silent."""
    gen = torch.Generator().manual_seed(11)
    for dup in (False, True):
        w = make_world(gen, [3, 5, 0], [2, 3, 1500], mode=FingerprintMode.NONE, with_truth=True, corrupt=0.0,
                       lut=lut, window=0, stamp=True, tag=0)
        if dup:
            w["out_cache_loc"][[3, 1200]] = w["out_cache_loc"][[0, 2]]  # B's first token onto A's, C's 1195th onto B's
        _, _, rows, _, _, _ = expected(w)
        assert len(rows) == (2 if dup else 0)
        assert all(r[7] == int(Reason.WRITE_CONFLICT) for r in rows)
        for backend in WITH_NUMBA:
            args, _ = run_op(check_forward, backend, **w, split=2)
            assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], w["ring"],
                        int(w["ring_counter"]), rows)


def test_split_fills_the_device_without_idle_rows():
    assert verify_split(1, 32768, 1024) == 32
    assert verify_split(1, 512, 1024) == 1
    assert verify_split(256, 32768, 256) == 4
    assert verify_split(4096, 32768, 32) == 1


def valid_world() -> dict:
    return make_world(torch.Generator().manual_seed(3), [4, 6], [2, 1], mode=FingerprintMode.NONE, with_truth=True,
                      corrupt=0.0, lut=False, window=0, stamp=True, tag=0)


@pytest.mark.parametrize(("change", "exc", "fragment"), [
    (dict(input_ids=torch.zeros(3, dtype=torch.int32)), TypeError, "input_ids"),
    (dict(positions=torch.zeros(2, dtype=torch.int64)), ValueError, "positions length 2 != len(input_ids) (3)"),
    (dict(extend_lens=torch.tensor([2, 2])), ValueError, "extend_lens sum 4 != len(input_ids) (3)"),
    (dict(prefix_lens=torch.tensor([4])), ValueError, "prefix_lens length 1 != bs (2)"),
    (dict(truth_lens=None), ValueError, "truth and truth_lens go together"),
    (dict(window=-1), ValueError, "window -1 < 0"),
    (dict(req_pool_indices=torch.tensor([1, 9])), ValueError, "req_pool_indices[1] out of range"),
    (dict(workspace=Workspace.allocate(1, 8)), ValueError, "workspace max_bs 1 < bs (2)"),
    (dict(workspace="x"), TypeError, "state.workspaces[0] must be a Workspace"),
    (dict(split=0), ValueError, "split 0 out of range [1, 1024]"),
    (dict(held=torch.tensor([3]), held_words=torch.tensor([1, 3])), ValueError, "pass one of them, got both"),
    (dict(held=None, held_words=torch.zeros(0, dtype=torch.int64)), ValueError, "held_words length 0 < 1"),
    (dict(held=None, held_words=torch.tensor([1, 3], dtype=torch.int32)), TypeError, "held_words"),
    (dict(held=None, held_words=torch.tensor([[1, 3]])), ValueError, "held_words"),
])
def test_validation_errors(change, exc, fragment):
    w = valid_world() | change
    with pytest.raises(exc) as info:
        with_state(check_forward, **w, backend=Backend.TRITON)
    assert fragment in str(info.value)


def test_workspace_errors():
    with pytest.raises(ValueError, match="max_bs 0 < 1"):
        Workspace.allocate(0, 8)
    with pytest.raises(ValueError, match="max_tokens 0 < 1"):
        Workspace.allocate(2, 0)


@pytest.mark.parametrize("backend", [Backend.TORCH, Backend.AUTO], ids=["torch", "auto"])
def test_a_batch_changed_after_its_head_is_validated_again(backend):
    """HEAD and TAIL of one forward validate its batch once; a tensor changed in place since (or
    replaced) is checked again, so the bad value is refused before anything is written."""
    w = valid_world()
    state = DeviceState(w.pop("canary"), w.pop("ring"), w.pop("ring_counter"), w.pop("stats"),
                        source_tags=w.pop("source_tags"))
    check_forward(state=state, **w, backend=backend)
    check_forward(state=state, **(w | dict(stamp=False)), backend=backend)  # the same batch: passes again
    before = state.records.clone()
    w["req_pool_indices"][1] = 9
    with pytest.raises(ValueError, match=r"req_pool_indices\[1\] out of range"):
        check_forward(state=state, **(w | dict(stamp=False)), backend=backend)
    w["req_pool_indices"] = torch.tensor([1, -1])
    with pytest.raises(ValueError, match=r"req_pool_indices\[1\] out of range"):
        check_forward(state=state, **w, backend=backend)
    assert state.records.equal(before)


@pytest.mark.parametrize("stamp", [True, False], ids=["head", "tail"])
def test_requests_sharing_a_damaged_prefix_report_every_entry(stamp):
    """Two requests whose page tables share a damaged prefix (a prefix-cache hit): each request's
    entries are checked and reported in entry order, fingerprints included, by every backend
    (the compiled kernel folds each distinct slot once)."""
    gen = torch.Generator().manual_seed(21)
    w = make_world(gen, [14, 2, 5], [1, 1, 2], mode=FingerprintMode.PARTIAL, with_truth=True, corrupt=0.3,
                   lut=False, window=0, stamp=stamp, tag=4)
    w["req_pool_indices"] = torch.tensor([1, 2, 3])
    w["req_to_token"][2, :14] = w["req_to_token"][1, :14]  # request 2 reads request 1's 14 slots
    w["prefix_lens"][1] = 14
    w["truth"][2, :14] = w["truth"][1, :14]
    w["truth_lens"][1] = 14
    rows = check_all(w)
    shared = {int(s) for s in w["req_to_token"][1, :14].tolist()}
    twice = [s for s in shared if sum(r[1] == s for r in rows) >= 2]
    assert twice, "no shared slot was reported for both requests"
    if not stamp:
        assert any(r[7] & int(Reason.FINGERPRINT) and r[1] in shared for r in rows)
