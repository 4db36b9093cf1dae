"""The edges random worlds rarely draw, made explicit for ``check_forward`` on every backend that
runs it (torch, Triton under the interpreter, the compiled CPU kernels): slot 1 and the last slot
as write targets and as prefix entries, a real request's token written to the padding slot 0 or
past the pool, exactly one held slot, the last slot read and written in one forward. Every
expected row is written out by hand from ``core.hashing`` (not from the reference ops), and every
damaged case has its clean twin asserting zero rows."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.hashing import ANCHOR, link, to_signed
from kvcanary.core.record import (
    STAT_CHECKED,
    STAT_LAUNCHES,
    STAT_STAMPED,
    LaunchPoint,
    LaunchTag,
    Reason,
    new_ring,
    new_stats,
    record_words,
)
from kvcanary.ops._common import Backend
from kvcanary.ops.check import check_forward
from kvcanary.ops.state import DeviceState

from ._helpers import WITH_NUMBA, WITH_NUMBA_IDS, device_for, ring_rows

NUM_SLOTS = 10  # slots 2, 6 and 8 stay free after the prefill
LAST = NUM_SLOTS - 1
HEAD, TAIL = LaunchTag(LaunchPoint.HEAD).value, LaunchTag(LaunchPoint.TAIL).value
# request 1 (page-table row 1): tokens 11, 12, 13 in slots 1, LAST, 4; request 2 (row 2): 21, 22 in slots 3, 5
A, SLOTS_A = [11, 12, 13], [1, LAST, 4]
B, SLOTS_B = [21, 22], [3, 5]
FREE = 6
BACKEND = pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)


def chains(tokens: list[int]) -> list[int]:
    """The signed chain entering each position of ``tokens``, by hand: ANCHOR, then + link."""
    out, c = [], ANCHOR
    for p, t in enumerate(tokens):
        out.append(to_signed(c))
        c = (c + link(t, p)) % 2**64
    return out


CA, CB = chains(A + [14]), chains(B + [23])


def row(tag, slot, pos, tok, exp_tok, stored, expected, reasons) -> list[int]:
    return [tag, slot, pos, tok, exp_tok, stored, expected, int(reasons)]


class World:
    """Two requests prefilled by one HEAD of ``check_forward`` on ``backend``; ``decode`` runs the
    next HEAD (or TAIL) with one token per request written where the test says."""

    def __init__(self, backend: Backend):
        self.backend, self.dev = backend, device_for(backend)
        gen = torch.Generator().manual_seed(5)
        canary = torch.randint(0, 256, (NUM_SLOTS, 32), dtype=torch.uint8, generator=gen).to(self.dev)
        ring, counter = new_ring(16, self.dev)
        self.state = DeviceState(canary, ring, counter, new_stats(self.dev))
        self.rtt = torch.zeros(3, 6, dtype=torch.int32, device=self.dev)
        self.rtt[1, :3] = self.t(SLOTS_A)
        self.rtt[2, :2] = self.t(SLOTS_B)
        self.run(prefix=[0, 0], extend=[3, 2], ids=A + B, pos=[0, 1, 2, 0, 1], loc=SLOTS_A + SLOTS_B)
        assert self.take() == []

    def t(self, xs, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=self.dev)

    @property
    def words(self) -> list[list[int]]:
        return record_words(self.state.records).cpu().tolist()

    def run(self, prefix, extend, ids, pos, loc, rows=(1, 2), stamp=True, **kw) -> None:
        check_forward(state=self.state, req_pool_indices=self.t(list(rows)), prefix_lens=self.t(prefix),
                      extend_lens=self.t(extend), req_to_token=self.rtt, input_ids=self.t(ids), positions=self.t(pos),
                      out_cache_loc=self.t(loc), tag=HEAD if stamp else TAIL, stamp=stamp, backend=self.backend,
                      **{k: v.to(self.dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    def decode(self, a_slot: int = FREE, b_slot: int = 2, stamp: bool = True, **kw) -> list[list[int]]:
        """Request 1 writes 14 at position 3 into ``a_slot``, request 2 writes 23 at 2 into ``b_slot``."""
        self.rtt[1, 3], self.rtt[2, 2] = a_slot, b_slot
        self.run(prefix=[3, 2], extend=[1, 1], ids=[14, 23], pos=[3, 2], loc=[a_slot, b_slot], stamp=stamp, **kw)
        return self.take()

    def take(self) -> list[list[int]]:
        rows = ring_rows(self.state.ring, self.state.ring_counter)
        assert int(self.state.ring_counter[0]) == len(rows)  # the ring never overflows here
        self.state.ring_counter.zero_()
        return rows

    def stat(self, tag: int, which: int) -> int:
        return int(self.state.stats[tag, which])


@BACKEND
def test_prefill_stamps_slot_1_and_the_last_slot(backend):
    w = World(backend)
    assert w.words[1] == [11, 0, CA[0], 0] and w.words[LAST] == [12, 1, CA[1], 0] and w.words[4] == [13, 2, CA[2], 0]
    assert w.words[3] == [21, 0, CB[0], 0] and w.words[5] == [22, 1, CB[1], 0]
    assert w.stat(HEAD, STAT_STAMPED) == 5 and w.stat(HEAD, STAT_LAUNCHES) == 1 and w.stat(HEAD, STAT_CHECKED) == 0
    assert w.decode() == []  # the clean twin of every test below
    assert w.stat(HEAD, STAT_CHECKED) == 5 and w.stat(HEAD, STAT_STAMPED) == 7
    assert w.words[FREE] == [14, 3, CA[3], 0] and w.words[2] == [23, 2, CB[2], 0]


@BACKEND
@pytest.mark.parametrize("stamp", [True, False], ids=["head", "tail"])
@pytest.mark.parametrize("damaged", [0, 1], ids=["slot_1", "last_slot"])
def test_damage_in_slot_1_or_the_last_slot_is_found(backend, stamp, damaged):
    """A prefix entry at either end of the pool with its chain word flipped: its own row and its
    successor's, at HEAD and at TAIL."""
    w = World(backend)
    slot = SLOTS_A[damaged]
    bad = CA[damaged] ^ (1 << 40)
    record_words(w.state.records)[slot, 2] = bad
    succ = damaged + 1
    want = [row(w_tag := HEAD if stamp else TAIL, slot, damaged, A[damaged], -1, bad, CA[damaged], Reason.CHAIN),
            row(w_tag, SLOTS_A[succ], succ, A[succ], -1, CA[succ], to_signed(bad + link(A[damaged], damaged)),
                Reason.CHAIN)]
    assert w.decode(stamp=stamp) == sorted(want)


@BACKEND
@pytest.mark.parametrize("target", [0, NUM_SLOTS, -1], ids=["slot_0", "past_the_pool", "negative"])
def test_a_real_requests_token_written_to_no_slot_is_a_bad_entry_at_head(backend, target):
    """Request 1's token written to the padding slot 0 (or outside the pool): one BAD_ENTRY row
    naming the target, position, token and the request's row; the slot is not stamped. The twin
    where a padding request (row 0) writes slot 0 stays silent and stamps nothing."""
    w = World(backend)
    before = w.words
    w.run(prefix=[0, 2], extend=[1, 1], ids=[14, 23], pos=[0, 2], loc=[0, 2], rows=(0, 2))
    assert w.take() == []
    assert w.words[0] == before[0] and w.words[2] == [23, 2, CB[2], 0]
    w = World(backend)
    before = w.words
    assert w.decode(a_slot=target) == [row(HEAD, target, 3, 14, 14, 1, target, Reason.BAD_ENTRY)]
    assert w.words[0] == before[0]
    assert w.words[2] == [23, 2, CB[2], 0]  # request 2 is stamped all the same
    assert w.stat(HEAD, STAT_STAMPED) == 5 + 1


@BACKEND
def test_writing_the_last_slot_while_another_request_reads_it_is_a_read_conflict(backend):
    w = World(backend)
    assert w.decode(b_slot=LAST) == [row(HEAD, LAST, 2, 23, -1, 2, 1, Reason.READ_CONFLICT)]
    w = World(backend)
    assert w.decode(b_slot=1) == [row(HEAD, 1, 2, 23, -1, 2, 1, Reason.READ_CONFLICT)]


@BACKEND
@pytest.mark.parametrize("counted", [False, True], ids=["held", "held_words"])
@pytest.mark.parametrize("target", [FREE, LAST - 1], ids=["free", "one_below_last"])
def test_a_write_into_exactly_one_held_slot(backend, counted, target):
    """One slot held by the prefix cache (no request reads it), written by request 1: one
    READ_CONFLICT row naming row 0 as the reader. Its twin (one held slot nobody writes) is silent."""
    w = World(backend)
    held = torch.tensor([target], dtype=torch.int64)
    kw = dict(held_words=torch.tensor([1, target], dtype=torch.int64)) if counted else dict(held=held)
    assert w.decode(a_slot=LAST - 1 if target == FREE else FREE, **kw) == []
    w = World(backend)
    # counted: the word after the count (request 2's target, slot 2) is past the count: not held
    # on the run's device, so that the count HEAD consumes is read back from the tensor it wrote
    kw = dict(held_words=w.t([1, target, 2])) if counted else dict(held=held)
    assert w.decode(a_slot=target, **kw) == [row(HEAD, target, 3, 14, -1, 1, 0, Reason.READ_CONFLICT)]
    assert w.words[target] == [14, 3, CA[3], 0]  # the write happened: it is stamped
    if counted:  # HEAD consumed the count, and only the count
        assert kw["held_words"].cpu().tolist() == [0, target, 2]


@BACKEND
def test_two_writes_into_one_slot_name_the_first_writer(backend):
    w = World(backend)
    assert w.decode(a_slot=FREE, b_slot=FREE) == [row(HEAD, FREE, 2, 23, -1, 2, 1, Reason.WRITE_CONFLICT)]


@BACKEND
@pytest.mark.parametrize("stamp", [True, False], ids=["head", "tail"])
def test_a_window_reads_its_last_positions_linked_to_the_one_before(backend, stamp):
    """A sliding window of 2: request 1 (prefix 3) checks positions 1 and 2, position 1 against
    its predecessor at position 0 (outside the window, not itself checked); request 2 (prefix 2)
    checks both. Damage at position 0 shows only through position 1's link."""
    tag = HEAD if stamp else TAIL
    w = World(backend)
    assert w.decode(stamp=stamp, window=2) == []
    assert w.stat(tag, STAT_CHECKED) == 4
    bad = CA[0] ^ (1 << 9)
    record_words(w.state.records)[SLOTS_A[0], 2] = bad
    assert w.decode(stamp=stamp, window=2) == [
        row(tag, LAST, 1, A[1], -1, CA[1], to_signed(bad + link(A[0], 0)), Reason.CHAIN)]
    assert w.stat(tag, STAT_CHECKED) == 8


@BACKEND
def test_a_write_that_does_not_follow_its_seeds_position_names_the_seeds_successor(backend):
    """Request 1's last prefix record (its seed) claims position 1 instead of 2: the prefix check
    names it (POSITION), and the decode write at position 3 is a WRITE_POSITION row expecting the
    seed's position + 1 = 2."""
    w = World(backend)
    record_words(w.state.records)[SLOTS_A[2], 1] = 1
    assert w.decode() == sorted([row(HEAD, SLOTS_A[2], 1, A[2], -1, 1, 2, Reason.POSITION),
                                 row(HEAD, FREE, 3, 14, 14, 3, 2, Reason.WRITE_POSITION)])
