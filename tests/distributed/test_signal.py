"""The agreement's pieces that need no second process: the chain digest, the ring summary, and
the divergences decoded from an agreed table."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.hashing import ANCHOR_S, link_torch
from kvcanary.core.record import (
    CHAIN,
    COL_REASONS,
    COL_TAG,
    POSITION,
    TOKEN,
    LaunchPoint,
    LaunchTag,
    Reason,
    new_canary,
    new_ring,
    record_words,
)
from kvcanary.distributed import DIVERGENCE_RE, Cause, chain_digest, find_divergences
from kvcanary.distributed.signal import ALARM_BIT, POINT_SHIFT, RingSummary, decode_code

GEN = torch.Generator().manual_seed(7)


def stamped(num_slots: int, sequences: dict[int, list[int]], slots: dict[int, list[int]]) -> torch.Tensor:
    """A canary whose slots ``slots[row]`` hold ``sequences[row]``'s records (token, position, chain)."""
    canary = new_canary(num_slots)
    words = record_words(canary)
    for row, tokens in sequences.items():
        chain = ANCHOR_S
        for pos, (tok, slot) in enumerate(zip(tokens, slots[row], strict=True)):
            words[slot, TOKEN], words[slot, POSITION], words[slot, CHAIN] = tok, pos, chain
            chain = int((torch.tensor(chain) + link_torch(torch.tensor(tok), torch.tensor(pos))).item())
    return canary


def batch_of(slots: dict[int, list[int]], rows: list[int]):
    """(req_pool_indices, extend_lens, out_cache_loc) of a decode batch: each row writes its last slot."""
    return (torch.tensor(rows), torch.ones(len(rows), dtype=torch.int64),
            torch.tensor([slots[r][-1] if r else 0 for r in rows]))


def random_tokens(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=GEN).tolist()


def test_chain_digest_depends_on_content_and_rows_not_on_slots():
    seqs = {1: random_tokens(9), 2: random_tokens(5)}
    slots_a = {1: list(range(3, 12)), 2: list(range(20, 25))}
    slots_b = {1: list(range(40, 49)), 2: [31, 7, 50, 2, 60]}  # same content, other slots
    a = chain_digest(stamped(64, seqs, slots_a), *batch_of(slots_a, [1, 2]))
    b = chain_digest(stamped(64, seqs, slots_b), *batch_of(slots_b, [1, 2]))
    assert a.shape == (1,) and a.dtype == torch.int64 and int(a) != 0
    assert torch.equal(a, b)  # content-only: another rank's pool places the same sequences elsewhere
    # one token of one sequence differs (the newest, or one deep in the prefix): another digest
    for i in (8, 2):
        other = {1: seqs[1][:i] + [(seqs[1][i] + 1) % 256] + seqs[1][i + 1:], 2: seqs[2]}
        assert int(chain_digest(stamped(64, other, slots_a), *batch_of(slots_a, [1, 2]))) != int(a)
    # batch order and page-table rows are part of it; padding rows (row 0) are not
    assert int(chain_digest(stamped(64, seqs, slots_a), *batch_of(slots_a, [2, 1]))) != int(a)
    padded = chain_digest(stamped(64, seqs, slots_a), *batch_of(slots_a, [1, 2, 0, 0]))
    assert torch.equal(padded, a)


def test_chain_digest_of_an_empty_batch_is_zero():
    empty = torch.zeros(0, dtype=torch.int64)
    assert int(chain_digest(new_canary(8), empty, empty, empty)) == 0


def ring_with(rows: list[tuple[LaunchPoint, Reason]], capacity: int = 8) -> torch.Tensor:
    ring, _ = new_ring(capacity)
    for i, (point, reasons) in enumerate(rows):
        ring[i] = torch.randint(1, 1000, (8,), generator=GEN)
        ring[i, COL_TAG], ring[i, COL_REASONS] = LaunchTag(point).value, int(reasons)
    return ring


@pytest.mark.parametrize("masked", [False, True], ids=["host-bounds", "masked-as-on-cuda"])
def test_ring_summary_counts_rows_in_range_and_ors_their_bits(masked):
    ring = ring_with([(LaunchPoint.SWEEP, Reason.FINGERPRINT), (LaunchPoint.HEAD, Reason.CHAIN | Reason.POSITION),
                      (LaunchPoint.TAIL, Reason.VERIFY_TOKEN)])
    summary = RingSummary(ring, masked)
    assert summary.masked is masked
    t = lambda x: torch.tensor([x])
    rows, code = summary(t(1), t(3))
    assert int(rows) == 2
    reasons, points, alarm = decode_code(int(code))
    assert reasons == Reason.CHAIN | Reason.POSITION | Reason.VERIFY_TOKEN
    assert points == (LaunchPoint.HEAD, LaunchPoint.TAIL) and not alarm
    assert [int(x) for x in summary(t(0), t(1))] == [1, Reason.FINGERPRINT | 1 << (POINT_SHIFT + LaunchPoint.SWEEP)]
    assert [int(x) for x in summary(t(3), t(3))] == [0, 0]
    # rows past the ring's capacity (dropped) still count, without bits
    full = RingSummary(ring[:3], masked)
    rows, code = full(t(3), t(20))
    assert int(rows) == 17 and int(code) == 0
    rows, code = full(t(2), t(20))
    assert int(rows) == 18 and decode_code(int(code))[:2] == (Reason.VERIFY_TOKEN, (LaunchPoint.TAIL,))


def table(*rows: tuple[int, int, int]) -> list[list[int]]:
    """(violation rows, code, digest) per rank -> an agreed table of step 5."""
    return [[n, code, digest, 5] for n, code, digest in rows]


HEAD_CHAIN = int(Reason.CHAIN | Reason.POSITION) | 1 << (POINT_SHIFT + LaunchPoint.HEAD)


def test_no_divergence_when_the_ranks_agree():
    assert find_divergences(5, table((0, 0, 11), (0, 0, 11))) == []
    # every rank found the same violations itself: each reports them, no rank is the odd one out
    assert find_divergences(5, table((2, HEAD_CHAIN, 11), (2, HEAD_CHAIN, 11))) == []


def test_a_violation_on_one_rank_is_a_divergence_naming_it():
    (d,) = find_divergences(5, table((0, 0, 11), (2, HEAD_CHAIN, 11), (0, 0, 11)), observer=2)
    assert d.cause is Cause.VIOLATIONS and d.ranks == (1,) and d.world == 3 and d.step == 5 and d.observer == 2
    line = d.line()
    m = DIVERGENCE_RE.match(line)
    assert m, line
    assert m["rank"] == "2" and m["ranks"] == "1" and m["cause"] == "violations"
    assert m["detail"] == "1:chain+position@HEAD(2)"
    per_rank = d.to_json()["per_rank"][1]
    assert per_rank["reasons"] == ["chain", "position"] and per_rank["launch_points"] == ["HEAD"]


def test_a_digest_mismatch_names_the_ranks_off_the_common_digest():
    (d,) = find_divergences(5, table((0, 0, 11), (0, 0, 11), (0, 0, -3)))
    assert d.cause is Cause.CHAIN_DIGEST and d.ranks == (2,)
    assert DIVERGENCE_RE.match(d.line())["cause"] == "chain_digest"
    # a tie (two ranks): the rank that differs from rank 0
    (d,) = find_divergences(5, table((0, 0, 11), (0, 0, 12)))
    assert d.ranks == (1,)
    # both causes at once
    causes = {x.cause for x in find_divergences(5, table((1, HEAD_CHAIN, 11), (0, 0, 12)))}
    assert causes == {Cause.VIOLATIONS, Cause.CHAIN_DIGEST}


def test_watchdog_alarm_bit_decodes():
    reasons, points, alarm = decode_code(ALARM_BIT | HEAD_CHAIN)
    assert alarm and points == (LaunchPoint.HEAD,) and reasons == Reason.CHAIN | Reason.POSITION


@pytest.mark.parametrize("masked", [False, True], ids=["host-bounds", "masked-as-on-cuda"])
def test_ring_summary_reads_the_launch_point_below_a_source_mask(masked):
    """A fingerprint row's tag column carries the differing sources above bit 8: the point is TAIL."""
    ring = ring_with([(LaunchPoint.TAIL, Reason.FINGERPRINT)])
    ring[0, COL_TAG] |= 0b1010 << 8
    rows, code = RingSummary(ring, masked)(torch.tensor([0]), torch.tensor([1]))
    assert int(rows) == 1 and decode_code(int(code)) == (Reason.FINGERPRINT, (LaunchPoint.TAIL,), False)
