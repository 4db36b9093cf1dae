"""verify: agreement of the three implementations, then the fault matrix: every fail reason
provoked by one crafted corruption of a cleanly stamped pool, with the exact rows expected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.core.hashing import chain_values, link, to_signed
from kvcanary.core.record import (
    CHAIN,
    FINGERPRINT,
    POSITION,
    STAT_CHECKED,
    STAT_LAUNCHES,
    TOKEN,
    Half,
    LaunchPoint,
    LaunchTag,
    PoolKind,
    Reason,
    new_canary,
    new_ring,
    new_stats,
    record_words,
)
from kvcanary.errors import InputError
from kvcanary.ops._common import Backend
from kvcanary.ops._cpu import BoundForward
from kvcanary.ops._cpu import usable as numba_usable
from kvcanary.ops.bound import BoundVerify
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.stamp import stamp
from kvcanary.ops.verify import verify

from . import reference as ref
from ._compare import assert_same, sorted_rows
from ._helpers import (
    SEEDS,
    WITH_NUMBA,
    WITH_NUMBA_IDS,
    assert_ring,
    damage_sources,
    device_for,
    on_device,
    plan_lists,
    plan_of,
    random_canary,
    random_tags,
    ring_rows,
    run_op,
    token_ids,
    with_state,
    words_of,
)

MODES = [FingerprintMode.NONE, FingerprintMode.PARTIAL, FingerprintMode.ALL]


# --- random agreement --------------------------------------------------------------------------

def kv_sources(gen: torch.Generator, num_slots: int, page_size: int, bytes_per_token: int, n: int = 2
               ) -> list[KVSource]:
    pages = -(-num_slots // page_size)
    return [KVSource.from_buffer(torch.randint(0, 256, (pages, page_size, bytes_per_token), dtype=torch.uint8,
                                               generator=gen), page_size=page_size,
                                 half=Half(int(torch.randint(0, 2, (1,), generator=gen))), layer=i)
            for i in range(n)]


def make_inputs(gen: torch.Generator, seq_lens: list[int], mode: FingerprintMode, with_truth: bool,
                corrupt: float, tag: int) -> dict:
    """Sequences stamped clean (reference chain, real fingerprints) into random slots of a random
    canary, a plan reading all of them, then a fraction ``corrupt`` of records and plan entries damaged."""
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 3 + int(torch.randint(0, 4, (1,), generator=gen))
    max_ctx = max(seq_lens, default=0) + 1
    canary = random_canary(gen, num_slots)
    words = record_words(canary)
    tags = random_tags(gen, num_slots)
    sources = kv_sources(gen, num_slots, int(torch.randint(1, 4, (1,), generator=gen)), 32,
                         int(torch.randint(1, 5, (1,), generator=gen))) if mode else []
    ref_sources = [ref.RefSource.of(s) for s in sources]
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    rtt = torch.zeros(bs + 1, max_ctx, dtype=torch.int32)
    truth = torch.zeros(bs + 1, max_ctx, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        tokens = token_ids(gen, n, -(2**31), 2**31 - 1).tolist()
        slots, perm = perm[:n], perm[n:]
        rtt[r + 1, :n] = torch.tensor(slots, dtype=torch.int32)
        truth[r + 1, :n] = torch.tensor(tokens, dtype=torch.int32)
        for p, (s, c) in enumerate(zip(slots, chain_values(tokens), strict=True)):
            fp, tags[s] = ref.fingerprint_parts(s, ref_sources, mode) if mode else (0, tags[s])
            words[s] = torch.tensor([tokens[p], p, to_signed(c), fp])
    rpi = torch.arange(1, bs + 1)
    rpi[torch.rand(bs, generator=gen) < 0.15] = 0
    fields = ref.build_plan(rpi.tolist(), seq_lens, [0] * bs, rtt.tolist(), max_ctx,
                            plan_lists(Plan.allocate(sum(seq_lens) + 2, max(bs, 1))),
                            truth.tolist() if with_truth else None, max_ctx, seq_lens if with_truth else None)
    plan = plan_of(fields)
    m = int(plan.count[0])
    # damage: records (any word), and plan entries (slot, pred, position, token)
    bad = torch.rand(num_slots, generator=gen) < corrupt
    col = torch.randint(0, 4, (num_slots,), generator=gen)
    words[bad, col[bad]] += torch.randint(1, 3, (int(bad.sum()),), generator=gen)
    damage_sources(gen, sources, num_slots, corrupt)  # K/V bytes: parts of the fingerprint differ
    for name, choices in (("slot", [0, -1, num_slots, num_slots + 9, perm[0] if perm else 1]),
                          ("pred", [-1, 0, num_slots + 1, 1]), ("position", [0, 1, 5]), ("token", [-1, 7])):
        hit = torch.rand(m, generator=gen) < corrupt / 2
        values = torch.tensor(choices, dtype=torch.int32)[torch.randint(0, len(choices), (m,), generator=gen)]
        getattr(plan, name)[:m] = torch.where(hit, values, getattr(plan, name)[:m])
    ring, counter = new_ring(m + 3)
    counter += int(torch.randint(0, 3, (1,), generator=gen))
    stats = torch.randint(0, 50, new_stats().shape, generator=gen)
    return dict(canary=canary, plan=plan, ring=ring, ring_counter=counter, stats=stats, tag=tag, sources=sources,
                mode=mode, source_tags=tags)


def expected_verify(inputs: dict):
    ref_sources = [ref.RefSource.of(s) for s in inputs["sources"]]
    tags = inputs["source_tags"].tolist() if "source_tags" in inputs else None
    return ref.verify(words_of(inputs["canary"]), plan_lists(inputs["plan"]), inputs["tag"], ref_sources,
                      inputs["mode"], tags)


def check_all_backends(inputs: dict) -> list[list[int]]:
    rows, checked = expected_verify(inputs)
    want_stats = inputs["stats"].clone()
    want_stats[inputs["tag"], STAT_LAUNCHES] += 1
    want_stats[inputs["tag"], STAT_CHECKED] += checked
    for backend in WITH_NUMBA:
        args, _ = run_op(verify, backend, **inputs)
        assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], inputs["ring"],
                    int(inputs["ring_counter"]), rows)
        assert_same(f"stats [{backend.value}]", args["stats"], want_stats)
        assert_same(f"canary [{backend.value}] (verify never writes)", args["canary"], inputs["canary"])
        if "source_tags" in inputs:
            assert_same(f"side words [{backend.value}] (verify never writes)", args["source_tags"],
                        inputs["source_tags"])
    return rows


@given(seed=SEEDS, seq_lens=st.lists(st.integers(0, 12), max_size=5), mode=st.sampled_from(MODES),
       with_truth=st.booleans(), corrupt=st.sampled_from([0.0, 0.1, 0.4]), tag=st.integers(0, 11))
def test_matches_reference(seed, seq_lens, mode, with_truth, corrupt, tag):
    gen = torch.Generator().manual_seed(seed)
    rows = check_all_backends(make_inputs(gen, seq_lens, mode, with_truth, corrupt, tag))
    if corrupt == 0.0:
        assert rows == []


def test_one_long_prefix_among_short_ones():
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs(gen, [3, 2500, 1, 40], FingerprintMode.PARTIAL, with_truth=True, corrupt=0.01, tag=2)
    assert check_all_backends(inputs)


def test_empty_plan_counts_a_launch_only():
    gen = torch.Generator().manual_seed(2)
    inputs = make_inputs(gen, [], FingerprintMode.NONE, with_truth=False, corrupt=0.0, tag=9)
    assert int(inputs["plan"].count[0]) == 0
    assert check_all_backends(inputs) == []


def test_disabled_plan_checks_nothing():
    gen = torch.Generator().manual_seed(3)
    inputs = make_inputs(gen, [5, 6], FingerprintMode.ALL, with_truth=True, corrupt=0.5, tag=1)
    inputs["plan"].enable.zero_()
    assert check_all_backends(inputs) == []


def test_count_beyond_capacity_checks_capacity_entries():
    gen = torch.Generator().manual_seed(4)
    inputs = make_inputs(gen, [5, 6], FingerprintMode.NONE, with_truth=False, corrupt=0.5, tag=1)
    inputs["plan"].count.fill_(10**6)
    check_all_backends(inputs)


# --- the fault matrix --------------------------------------------------------------------------

A = [11, 12, 13, 14, 15, 16, 17, 18]
B = [21, 22, 23, 24, 25, 26]
SLOTS_A = [9, 3, 14, 5, 12, 7, 1, 10]
SLOTS_B = [2, 13, 6, 11, 4, 8]
NUM_SLOTS = 17  # 15 and 16 stay free
FREE = 15
CA = [to_signed(c) for c in chain_values(A + [19])]  # chain entering each position of A, then of the decode token
CB = [to_signed(c) for c in chain_values(B)]
HEAD = LaunchTag(LaunchPoint.HEAD).value
TAIL_V = LaunchTag(LaunchPoint.TAIL, PoolKind.FULL, Half.V).value
TAIL_K = LaunchTag(LaunchPoint.TAIL, PoolKind.FULL, Half.K).value
K_DIFFERS, V_DIFFERS = 1 << 8, 2 << 8  # the source mask of a fingerprint row: source 0 is K, source 1 is V
SWEEP_SWA = LaunchTag(LaunchPoint.SWEEP, PoolKind.SWA).value


def plus_link(chain: int, token: int, position: int) -> int:
    return to_signed(chain + link(token, position))


class Pool:
    """Requests A (row 1) and B (row 2) prefilled cleanly through the ops of one backend; K and V
    buffers with fingerprints recorded in ``mode``. Corrupt something, then ``check()`` the prefixes."""

    def __init__(self, backend: Backend, mode: FingerprintMode = FingerprintMode.NONE, truth: bool = False):
        self.backend, self.mode = backend, mode
        self.dev = dev = device_for(backend)
        gen = torch.Generator().manual_seed(99)
        self.kv = [torch.randint(0, 256, (9, 2, 64), dtype=torch.uint8, generator=gen).to(dev) for _ in range(2)]
        self.sources = [KVSource.from_buffer(buf, page_size=2, half=Half(i)) for i, buf in enumerate(self.kv)]
        self.canary = torch.zeros(NUM_SLOTS, 32, dtype=torch.uint8, device=dev)
        self.source_tags = torch.zeros(NUM_SLOTS, dtype=torch.int64, device=dev)
        self.req_to_token = torch.zeros(3, 10, dtype=torch.int32, device=dev)
        self.req_to_token[1, :8] = torch.tensor(SLOTS_A, dtype=torch.int32)
        self.req_to_token[2, :6] = torch.tensor(SLOTS_B, dtype=torch.int32)
        self.truth = None
        if truth:
            self.truth = torch.zeros(3, 10, dtype=torch.int32, device=dev)
            self.truth[1, :9] = torch.tensor(A + [19], dtype=torch.int32)
            self.truth[2, :6] = torch.tensor(B, dtype=torch.int32)
        self.ring, self.counter = new_ring(16, device=dev)
        self.stats = new_stats(device=dev)
        self.forward(prefix_lens=[0, 0], input_ids=A + B, positions=list(range(8)) + list(range(6)),
                     out_cache_loc=SLOTS_A + SLOTS_B, extend_lens=[8, 6])
        assert self.counter.tolist() == [0]

    def t(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.dev)

    @property
    def words(self) -> torch.Tensor:
        return record_words(self.canary)

    def plan(self, prefix_lens, extend_lens, rows=(1, 2)) -> Plan:
        truth = {} if self.truth is None else dict(truth=self.truth, truth_lens=self.t([9, 6][: len(rows)]))
        return build_plan(req_pool_indices=self.t(list(rows)), prefix_lens=self.t(prefix_lens),
                          extend_lens=self.t(extend_lens), req_to_token=self.req_to_token,
                          plan=Plan.allocate(32, 4, device=self.dev), backend=self.backend, **truth)

    def forward(self, prefix_lens, input_ids, positions, out_cache_loc, extend_lens, rows=(1, 2),
                expected_tokens=None, tag=HEAD):
        """Stamp one forward's writes, then record their fingerprints."""
        plan = self.plan(prefix_lens, extend_lens, rows)
        with_state(stamp, canary=self.canary, out_cache_loc=self.t(out_cache_loc), input_ids=self.t(input_ids),
              positions=self.t(positions), req_pool_indices=self.t(list(rows)), prefix_lens=self.t(prefix_lens),
              write_offsets=plan.write_offsets[: len(rows) + 1], seed=plan.seed[: len(rows)], ring=self.ring,
              ring_counter=self.counter, stats=self.stats, tag=tag, expected_tokens=expected_tokens,
              backend=self.backend)
        with_state(fingerprint, slots=self.t(out_cache_loc), sources=self.sources, mode=self.mode, canary=self.canary,
                   record=True, source_tags=self.source_tags, backend=self.backend)
        return plan

    def check(self, tag: int = HEAD, prefix_lens=(8, 6), with_sources: bool = False) -> list[list[int]]:
        """Verify both prefixes; returns the sorted new rows (and clears the ring)."""
        plan = self.plan(list(prefix_lens), [0, 0])
        sources = self.sources if with_sources else ()
        with_state(verify, canary=self.canary, plan=plan, ring=self.ring, ring_counter=self.counter,
                   stats=self.stats, tag=tag, sources=sources, source_tags=self.source_tags,
                   mode=self.mode if with_sources else FingerprintMode.NONE, backend=self.backend)
        return self.take_rows()

    def assert_clean(self) -> None:
        assert self.check() == []
        if self.mode:
            assert self.check(TAIL_V, with_sources=True) == []

    def take_rows(self) -> list[list[int]]:
        rows = ring_rows(self.ring, self.counter)
        assert int(self.counter) <= self.ring.shape[0]
        self.ring.fill_(-1)
        self.counter.zero_()
        return rows


def row(tag, slot, stored_pos, stored_tok, expected_tok, stored, expected, reasons) -> list[int]:
    return [tag, slot, stored_pos, stored_tok, expected_tok, stored, expected, int(reasons)]


BACKEND_PARAM = pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)


@BACKEND_PARAM
def test_clean_pool_has_no_violations(backend):
    for mode in MODES:
        pool = Pool(backend, mode, truth=True)
        assert pool.check() == []
        assert pool.check(TAIL_V, with_sources=True) == []
        assert pool.words[SLOTS_A, CHAIN].tolist() == CA[:8]
        assert pool.words[SLOTS_B, CHAIN].tolist() == CB
        assert pool.stats[HEAD, STAT_CHECKED].item() == 14 and pool.stats[TAIL_V, STAT_LAUNCHES].item() == 1


@BACKEND_PARAM
def test_chain_slot_from_another_prefix(backend):
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    pool.req_to_token[1, 4] = SLOTS_B[4]  # A's position 4 now points at B's position 4: same position, other prefix
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_B[4], 4, B[4], -1, CB[4], CA[4], Reason.CHAIN),
        row(HEAD, SLOTS_A[5], 5, A[5], -1, CA[5], CB[5], Reason.CHAIN),  # its successor links to B's chain
    ])


@BACKEND_PARAM
def test_chain_slot_from_another_prefix_with_truth(backend):
    pool = Pool(backend, truth=True)
    pool.assert_clean()  # the clean twin
    pool.req_to_token[1, 4] = SLOTS_B[4]
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_B[4], 4, B[4], A[4], CB[4], CA[4], Reason.CHAIN | Reason.VERIFY_TOKEN),
        row(HEAD, SLOTS_A[5], 5, A[5], A[5], CA[5], CB[5], Reason.CHAIN),
    ])


@BACKEND_PARAM
@pytest.mark.parametrize("p", [0, 3, 7])
def test_chain_corrupted_word(backend, p):
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    bad = CA[p] ^ (1 << 17)
    pool.words[SLOTS_A[p], CHAIN] = bad
    want = [row(HEAD, SLOTS_A[p], p, A[p], -1, bad, CA[p], Reason.CHAIN)]  # p = 0: expected is ANCHOR = CA[0]
    if p + 1 < len(A):
        want.append(row(HEAD, SLOTS_A[p + 1], p + 1, A[p + 1], -1, CA[p + 1], plus_link(bad, A[p], p), Reason.CHAIN))
    assert pool.check() == sorted_rows(want)


@BACKEND_PARAM
def test_position_corrupted_word(backend):
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    pool.words[SLOTS_A[2], POSITION] = 7
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_A[2], 7, A[2], -1, 7, 2, Reason.POSITION),
        row(HEAD, SLOTS_A[3], 3, A[3], -1, CA[3], plus_link(CA[2], A[2], 7), Reason.CHAIN),
    ])


@BACKEND_PARAM
def test_position_swapped_page_table_entries(backend):
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    pool.req_to_token[1, [2, 5]] = torch.tensor([SLOTS_A[5], SLOTS_A[2]], dtype=torch.int32, device=pool.dev)
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_A[5], 5, A[5], -1, CA[5], CA[2], Reason.CHAIN | Reason.POSITION),  # read at position 2
        row(HEAD, SLOTS_A[3], 3, A[3], -1, CA[3], CA[6], Reason.CHAIN),  # its predecessor is now position 5's slot
        row(HEAD, SLOTS_A[2], 2, A[2], -1, CA[2], CA[5], Reason.CHAIN | Reason.POSITION),  # read at position 5
        row(HEAD, SLOTS_A[6], 6, A[6], -1, CA[6], CA[3], Reason.CHAIN),
    ])


@BACKEND_PARAM
def test_position_swapped_adjacent_entries(backend):
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    pool.req_to_token[1, [3, 4]] = torch.tensor([SLOTS_A[4], SLOTS_A[3]], dtype=torch.int32, device=pool.dev)
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_A[4], 4, A[4], -1, CA[4], CA[3], Reason.CHAIN | Reason.POSITION),
        row(HEAD, SLOTS_A[3], 3, A[3], -1, CA[3], CA[5], Reason.CHAIN | Reason.POSITION),
        row(HEAD, SLOTS_A[5], 5, A[5], -1, CA[5], CA[4], Reason.CHAIN),
    ])


@BACKEND_PARAM
@pytest.mark.parametrize("mode", [FingerprintMode.PARTIAL, FingerprintMode.ALL], ids=lambda m: m.name)
@pytest.mark.parametrize("byte", [0, 3, 15, 16, 40, 63])
def test_fingerprint_flipped_kv_byte(backend, mode, byte):
    pool = Pool(backend, mode)
    assert pool.check(TAIL_V, with_sources=True) == []
    slot = SLOTS_A[4]
    stored = pool.words[slot, FINGERPRINT].item()
    pool.kv[1][slot // 2, slot % 2, byte] ^= 0x10  # V buffer, token row of the slot (page size 2)
    rows = pool.check(TAIL_K, with_sources=True)  # the launch tag of a pool's TAIL: its first source's half
    if mode is FingerprintMode.PARTIAL and byte >= 16:
        assert rows == []  # partial mode reads the first 16 bytes only
    else:
        now = ref.fingerprint_slot(slot, [ref.RefSource.of(s) for s in pool.sources], mode)
        assert now != stored
        assert rows == [row(TAIL_V | V_DIFFERS, slot, 4, A[4], -1, stored, now, Reason.FINGERPRINT)]
    assert pool.check(HEAD) == []  # identity checks do not read the KV bytes


@BACKEND_PARAM
def test_fingerprint_stale_record_after_a_rewrite(backend):
    """A slot rewritten with other K/V but the same identity: only the fingerprint sees it."""
    pool = Pool(backend, FingerprintMode.ALL)
    pool.assert_clean()  # the clean twin
    slot = SLOTS_B[2]
    stored = pool.words[slot, FINGERPRINT].item()
    pool.kv[0][slot // 2, slot % 2] = pool.kv[0][SLOTS_B[3] // 2, SLOTS_B[3] % 2]
    now = ref.fingerprint_slot(slot, [ref.RefSource.of(s) for s in pool.sources], FingerprintMode.ALL)
    assert pool.check(TAIL_V, with_sources=True) == [row(TAIL_K | K_DIFFERS, slot, 2, B[2], -1, stored, now,
                                                         Reason.FINGERPRINT)]


@BACKEND_PARAM
def test_verify_token_truth_mismatch(backend):
    pool = Pool(backend, truth=True)
    assert pool.check() == []
    pool.truth[1, 3] = A[3] + 1
    assert pool.check() == [row(HEAD, SLOTS_A[3], 3, A[3], A[3] + 1, A[3], A[3] + 1, Reason.VERIFY_TOKEN)]
    pool.truth[1, 3] = A[3]
    pool.words[SLOTS_B[0], TOKEN] = 5  # a damaged token word breaks the next link too
    assert pool.check() == sorted_rows([
        row(HEAD, SLOTS_B[0], 0, 5, B[0], 5, B[0], Reason.VERIFY_TOKEN),
        row(HEAD, SLOTS_B[1], 1, B[1], B[1], CB[1], plus_link(CB[0], 5, 0), Reason.CHAIN),
    ])


def decode_a(pool: Pool, token: int = 19, position: int = 8, expected_tokens=None, last_prefix_slot=None):
    """One decode step of A (prefix 8) writing ``token`` into the free slot 15; returns the new rows."""
    if last_prefix_slot is not None:
        pool.req_to_token[1, 7] = last_prefix_slot
    pool.req_to_token[1, 8] = FREE
    pool.forward(prefix_lens=[8], input_ids=[token], positions=[position], out_cache_loc=[FREE], extend_lens=[1],
                 rows=(1,), expected_tokens=expected_tokens)
    return pool.take_rows()


@BACKEND_PARAM
def test_write_token_expected_mismatch(backend):
    clean = Pool(backend, truth=True)
    expected = gather_expected_tokens(truth=clean.truth, truth_lens=clean.t([9]), req_pool_indices=clean.t([1]),
                                      prefix_lens=clean.t([8]), extend_offsets=clean.t([0, 1]), input_ids=clean.t([19]),
                                      backend=backend)
    assert expected.tolist() == [19]
    assert decode_a(clean, expected_tokens=expected) == []
    assert clean.words[FREE].tolist()[:3] == [19, 8, CA[8]]
    pool = Pool(backend, truth=True)
    pool.truth[1, 8] = 20  # the engine samples 19 but the truth says 20
    expected = gather_expected_tokens(truth=pool.truth, truth_lens=pool.t([9]), req_pool_indices=pool.t([1]),
                                      prefix_lens=pool.t([8]), extend_offsets=pool.t([0, 1]), input_ids=pool.t([19]),
                                      backend=backend)
    assert decode_a(pool, expected_tokens=expected) == [row(HEAD, FREE, 8, 19, 20, 19, 20, Reason.WRITE_TOKEN)]
    assert pool.words[FREE].tolist()[:3] == [19, 8, CA[8]]  # stamped all the same: the write happened


@BACKEND_PARAM
def test_write_position_skewed(backend):
    assert decode_a(Pool(backend), position=8) == []
    pool = Pool(backend)
    assert decode_a(pool, position=9) == [row(HEAD, FREE, 9, 19, 19, 9, 8, Reason.WRITE_POSITION)]


@BACKEND_PARAM
def test_write_position_seed_mismatch(backend):
    """The page table's last prefix entry points at A's position 5: the write claims position 8,
    the seed says 6."""
    pool = Pool(backend)
    assert decode_a(pool, last_prefix_slot=SLOTS_A[5]) == [row(HEAD, FREE, 8, 19, 19, 8, 6, Reason.WRITE_POSITION)]
    assert pool.words[FREE, CHAIN].item() == plus_link(CA[5], A[5], 5)  # continued from the seed it was given


@BACKEND_PARAM
@pytest.mark.parametrize("target", [0, -1, NUM_SLOTS, NUM_SLOTS + 9])
def test_real_token_written_to_no_slot_is_a_bad_entry(backend, target):
    """A real request's token written to the padding slot 0 (or outside the pool) is a BAD_ENTRY
    row naming the target, the written position and token, and the request's page-table row;
    nothing is stamped. Its twin, a padding request (row 0) writing slot 0, stays silent."""
    pool = Pool(backend)
    before = pool.canary.clone()
    pool.forward(prefix_lens=[0], input_ids=[5], positions=[0], out_cache_loc=[0], extend_lens=[1], rows=(0,))
    assert pool.take_rows() == []  # padding lanes write slot 0 by design
    pool.req_to_token[1, 8] = target
    pool.forward(prefix_lens=[8], input_ids=[19], positions=[8], out_cache_loc=[target], extend_lens=[1], rows=(1,))
    assert pool.take_rows() == [row(HEAD, target, 8, 19, 19, 1, target, Reason.BAD_ENTRY)]
    assert torch.equal(pool.canary, before)


@BACKEND_PARAM
@pytest.mark.parametrize("entry", [NUM_SLOTS, NUM_SLOTS + 3, 2**31 - 1, -5, 0])
@pytest.mark.parametrize("truth", [False, True])
def test_bad_entry_is_named_by_value_position_and_row(backend, entry, truth):
    """A prefix entry resolving to no slot (the padding slot 0, negative, outside the pool) is a
    BAD_ENTRY row naming the entry as given, its position and the request's page-table row."""
    pool = Pool(backend, truth=truth)
    assert pool.check() == []
    pool.req_to_token[1, 4] = entry
    resolved = -1 if entry == 0 else entry  # a 0 inside a real request resolves to -1 in the plan
    expected_tok = A[4] if truth else -1
    # the successor's predecessor is invalid, so its chain check is skipped: one row only
    assert pool.check() == [row(HEAD, entry, 4, -1, expected_tok, 1, resolved, Reason.BAD_ENTRY)]


@BACKEND_PARAM
def test_sliding_window_lut(backend):
    """A sliding-window pool: the page table holds full-pool slots, the LUT maps them to this pool;
    only the last ``window`` positions are read, and an evicted slot inside the window is wild."""
    pool = Pool(backend)
    full = torch.tensor([100 + i for i in range(8)], dtype=torch.int32, device=pool.dev)
    lut = torch.zeros(120, dtype=torch.int64, device=pool.dev)
    lut[100:108] = torch.tensor(SLOTS_A, device=pool.dev)
    lut[100:103] = 0  # positions 0-2 fell out of the window
    rtt = torch.zeros(3, 10, dtype=torch.int32, device=pool.dev)
    rtt[1, :8] = full

    def check_swa():
        plan = build_plan(req_pool_indices=pool.t([1]), prefix_lens=pool.t([8]), extend_lens=pool.t([0]),
                          req_to_token=rtt, plan=Plan.allocate(16, 1, device=pool.dev), lut=lut, window=4,
                          backend=backend)
        with_state(verify, canary=pool.canary, plan=plan, ring=pool.ring, ring_counter=pool.counter, stats=pool.stats,
               tag=SWEEP_SWA, backend=backend)
        return pool.take_rows()

    assert check_swa() == []  # positions 4-7, with position 3's slot as the first predecessor
    lut[103] = 0  # the predecessor of the window's first slot evicted: that link is not checked
    assert check_swa() == []
    lut[105] = 0  # evicted inside the window
    assert check_swa() == [row(SWEEP_SWA, 105, 5, -1, -1, 1, -1, Reason.BAD_ENTRY)]  # full slot 105 has no window slot


@BACKEND_PARAM
def test_ring_overflow_keeps_counting(backend):
    """Every prefix slot damaged, a ring of 3 rows inside guard rows: the counter holds the true
    total, the ring holds 3 of the expected rows, nothing is written past it."""
    pool = Pool(backend)
    pool.assert_clean()  # the clean twin
    pool.words[SLOTS_A + SLOTS_B, POSITION] += 100
    want = ref.verify(words_of(pool.canary), plan_lists(pool.plan([8, 6], [0, 0])), HEAD)[0]
    assert len(want) == 14
    buf = torch.full((7, 8), -3, dtype=torch.int64, device=pool.dev)
    ring, counter = buf[2:5], torch.zeros(1, dtype=torch.int64, device=pool.dev)
    for launch in range(2):
        before = ring.cpu().clone()
        with_state(verify, canary=pool.canary, plan=pool.plan([8, 6], [0, 0]), ring=ring, ring_counter=counter,
                   stats=pool.stats, tag=HEAD, backend=backend)
        assert_ring(f"launch {launch}", ring, counter, before, 14 * launch, want)
        assert_same("guard rows", torch.cat([buf[:2], buf[5:]]), torch.full((4, 8), -3))
    assert counter.tolist() == [28]


# --- validation ------------------------------------------------------------------------------

def valid_args() -> dict:
    ring, counter = new_ring(4)
    return dict(canary=torch.zeros(8, 32, dtype=torch.uint8), plan=Plan.allocate(4, 2), ring=ring, ring_counter=counter,
                stats=new_stats(), tag=0)


SOURCE = KVSource.from_buffer(torch.zeros(8, 32, dtype=torch.uint8))


@pytest.mark.parametrize("change, exc, fragment", [
    (dict(canary=torch.zeros(8, 32, dtype=torch.int8)), TypeError, "state.records dtype int8 != uint8"),
    (dict(canary=torch.zeros(8, 16, dtype=torch.uint8)), ValueError, "state.records must be uint8[num_slots, 32]"),
    (dict(canary=torch.zeros(8, dtype=torch.uint8)), ValueError, "state.records must be 2-D"),
    (dict(plan=plan_lists(Plan.allocate(4, 2))), TypeError, "plan must be a Plan (Plan.allocate(...)), got dict"),
    (dict(mode=1), TypeError, "mode must be a FingerprintMode, got 1"),
    (dict(ring=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "ring dtype int32 != int64"),
    (dict(ring=torch.zeros(4, 9, dtype=torch.int64)), ValueError,
     "state.ring must be int64[capacity, 8], got shape (4, 9)"),
    (dict(ring_counter=torch.zeros(1, dtype=torch.int32)), TypeError, "ring_counter dtype int32 != int64"),
    (dict(ring_counter=torch.zeros(1, 1, dtype=torch.int64)), ValueError, "ring_counter must be 1-D"),
    (dict(stats=torch.zeros(3, 12, dtype=torch.int64)), ValueError,
     "state.stats must be int64[12, 3], got shape (3, 12)"),
    (dict(tag=12), ValueError, "tag 12 out of range [0, 12)"),
    (dict(plan=Plan.allocate(4, 2, device="meta")), ValueError, "plan is on meta but the state is on cpu"),
    (dict(sources=[SOURCE] * 5, mode=FingerprintMode.ALL), ValueError, "5 KV sources > 4"),
    (dict(sources=["k"], mode=FingerprintMode.ALL), TypeError, "sources[0] must be a KVSource, got str"),
    (dict(sources=[KVSource.from_buffer(torch.zeros(6, 32, dtype=torch.uint8))], mode=FingerprintMode.PARTIAL),
     ValueError, "sources[0] covers 6 slots < the canary's 8"),
])
def test_validation_errors(change, exc, fragment):
    for backend in WITH_NUMBA:
        with pytest.raises(exc) as info:
            with_state(verify, **{**valid_args(), **change}, backend=backend)
        assert fragment in str(info.value)


def test_sources_are_ignored_in_mode_none():
    args = valid_args()
    with_state(verify, **args, sources=["not", "validated"], mode=FingerprintMode.NONE)
    assert args["stats"][0].tolist() == [1, 0, 0]


def test_strided_canary_is_refused_on_every_backend():
    """A canary inside a wider buffer: refused by the state on both paths, nothing written."""
    gen = torch.Generator().manual_seed(5)
    inputs = make_inputs(gen, [4, 6], FingerprintMode.ALL, with_truth=True, corrupt=0.2, tag=3)
    for backend in WITH_NUMBA:
        args = {k: on_device(v, torch.device("cpu")) for k, v in inputs.items()}
        buf = torch.zeros(args["canary"].shape[0], 64, dtype=torch.uint8)
        buf[:, :32] = args["canary"]
        args["canary"] = buf[:, :32]
        with pytest.raises(InputError, match="state.records must be contiguous"):
            with_state(verify, **args, backend=backend)
        assert_same("ring", args["ring"], inputs["ring"])
        assert_same("stats", args["stats"], inputs["stats"])


@pytest.mark.parametrize("backend", WITH_NUMBA)
@pytest.mark.parametrize("count,enable,expected", [(5, 2, 5), (-3, 1, 0), (10**9, 1, 8), (5, 0, 0)])
def test_hand_written_plan_counts_stay_in_bounds(backend, count, enable, expected):
    """enable is a flag (any non-zero) and count is clamped to [0, capacity]: a hand-filled plan
    never makes verify read past its buffers; every checked entry is a wild slot here."""
    canary = new_canary(16)
    plan = Plan.allocate(8, 1)
    plan.slot.fill_(99)  # outside the 16-slot pool: each checked entry reports a bad entry
    plan.count.fill_(count)
    plan.enable.fill_(enable)
    ring, counter = new_ring(32)
    stats = new_stats()
    args, _ = run_op(verify, backend, canary=canary, plan=plan, ring=ring, ring_counter=counter, stats=stats, tag=0)
    assert int(args["ring_counter"][0]) == expected
    assert int(args["stats"][0, 1]) == expected and int(args["stats"][0, 0]) == 1


def _bound_verify(**inputs):
    """BoundVerify built and called on the loose buffers a test made (``with_state``)."""
    tag, plan, sources, mode = inputs.pop("tag"), inputs.pop("plan"), inputs.pop("sources"), inputs.pop("mode")
    inputs.pop("backend")
    return with_state(lambda state: BoundVerify(state, plan, sources, mode)(tag), **inputs)


@given(seed=SEEDS, seq_lens=st.lists(st.integers(0, 12), max_size=4), mode=st.sampled_from(MODES),
       corrupt=st.sampled_from([0.0, 0.3]), tag=st.integers(0, 11))
def test_bound_verify_matches_the_reference(seed, seq_lens, mode, corrupt, tag):
    """BoundVerify (state, plan, sources and meta checked once) reports what the reference does."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(gen, seq_lens, mode, False, corrupt, tag)
    rows, checked = expected_verify(inputs)
    want_stats = inputs["stats"].clone()
    want_stats[tag, STAT_LAUNCHES] += 1
    want_stats[tag, STAT_CHECKED] += checked
    args, _ = run_op(_bound_verify, Backend.TRITON, **inputs)
    assert_ring("ring [bound]", args["ring"], args["ring_counter"], inputs["ring"], int(inputs["ring_counter"]), rows)
    assert_same("stats [bound]", args["stats"], want_stats)


def _host_verify(inputs: dict, entries: tuple, tag: int) -> tuple[dict, bool]:
    """``BoundForward.verify`` (a CPU sweep's compiled verify of host entries) on copies of the
    inputs' buffers: (the buffers after it, whether it took the entries)."""
    args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    sources, mode = args["sources"], args["mode"]
    meta = source_meta(sources, mode, torch.device("cpu")) if sources else None
    done = with_state(lambda state: BoundForward(state, sources, meta, torch.zeros(1, 1, dtype=torch.int32),
                                                 torch.zeros(1, dtype=torch.int64), 0, 64).verify(*entries, tag),
                      canary=args["canary"], ring=args["ring"], ring_counter=args["ring_counter"], stats=args["stats"],
                      source_tags=args["source_tags"])
    return args, done


@pytest.mark.skipif(not numba_usable(), reason="numba does not serve here")
@given(seed=SEEDS, seq_lens=st.lists(st.integers(0, 12), min_size=1, max_size=4), mode=st.sampled_from(MODES),
       corrupt=st.sampled_from([0.0, 0.3]), tag=st.integers(0, 11), as_lists=st.booleans())
def test_a_sweeps_host_entries_verify_as_the_reference(seed, seq_lens, mode, corrupt, tag, as_lists):
    """A CPU sweep's entries (slot, predecessor, position, token; no request row, the entry its
    slot), as host lists or int64 arrays, verified by the compiled call: the reference's rows and
    counts; a value its int32 plan cannot hold: refused, nothing written."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(gen, seq_lens, mode, False, corrupt, tag)
    plan, m = inputs["plan"], int(inputs["plan"].count[0])
    plan.entry[:m], plan.row[:m] = plan.slot[:m], 0  # a sweep's: idle slots, no request
    columns = [getattr(plan, name)[:m].long() for name in ("slot", "pred", "position", "token")]
    entries = tuple(c.tolist() if as_lists else c.numpy() for c in columns)
    rows, checked = expected_verify(inputs)
    want_stats = inputs["stats"].clone()
    want_stats[tag, STAT_LAUNCHES] += 1
    want_stats[tag, STAT_CHECKED] += checked
    args, done = _host_verify(inputs, entries, tag)
    assert done
    assert_ring("ring [host entries]", args["ring"], args["ring_counter"], inputs["ring"],
                int(inputs["ring_counter"]), rows)
    assert_same("stats [host entries]", args["stats"], want_stats)
    if m:
        big = [list(c) for c in entries]
        big[int(torch.randint(0, 4, (1,), generator=gen))][m - 1] = 2**40
        args, done = _host_verify(inputs, tuple(big), tag)
        assert not done
        for name in ("canary", "ring", "ring_counter", "stats"):
            assert_same(f"{name} after a refused sweep", args[name], inputs[name])


def test_bound_verify_refuses_a_plan_resized_after_binding():
    inputs = make_inputs(torch.Generator().manual_seed(4), [3, 5], FingerprintMode.NONE, False, 0.0, 2)
    args = {k: on_device(v, device_for(Backend.TRITON)) for k, v in inputs.items()}
    bound = with_state(lambda state: BoundVerify(state, args["plan"]), canary=args["canary"], ring=args["ring"],
                       ring_counter=args["ring_counter"], stats=args["stats"])
    bound(2)
    args["plan"].token.resize_(1)
    with pytest.raises(InputError, match="plan buffers were resized or replaced"):
        bound(2)
    with pytest.raises(InputError, match="tag 40 out of range"):
        with_state(lambda state: BoundVerify(state, make_inputs(torch.Generator().manual_seed(5), [2],
                                                                FingerprintMode.NONE, False, 0.0, 0)["plan"])(40),
                   canary=inputs["canary"])
