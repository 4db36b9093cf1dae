from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import (
    NUM_LAUNCH_TAGS,
    NUM_STATS,
    RECORD_BYTES,
    VIOLATION_ROW_WIDTH,
    Half,
    LaunchPoint,
    LaunchTag,
    PoolKind,
    Reason,
    ViolationRow,
    decode_rows,
    format_reasons,
    new_canary,
    new_ring,
    new_stats,
    record_words,
)


def test_reason_bits_are_the_documented_ones():
    assert [(r.name, r.value) for r in Reason] == [("CHAIN", 1), ("POSITION", 2), ("FINGERPRINT", 4),
                                                   ("WRITE_TOKEN", 8), ("WRITE_POSITION", 16), ("VERIFY_TOKEN", 32),
                                                   ("BAD_ENTRY", 64), ("WRITE_CONFLICT", 128), ("READ_CONFLICT", 256),
                                                   ("MISSED_WRITE", 512)]


def test_reason_names_and_parse_round_trip():
    for bits in range(64):
        text = format_reasons(bits)
        assert int(Reason.parse(text if bits else "")) == bits
        assert Reason.names(bits) == ([] if bits == 0 else text.split("+"))
    assert format_reasons(0) == "none"
    assert format_reasons(Reason.CHAIN | Reason.POSITION) == "chain+position"
    assert Reason.parse("chain+position") == Reason.CHAIN | Reason.POSITION
    assert Reason.parse("Verify_Token") == Reason.VERIFY_TOKEN


def test_reason_parse_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown reason 'bogus'"):
        Reason.parse("chain+bogus")


def test_launch_tag_encode_decode_all():
    seen = set()
    for point in LaunchPoint:
        for pool in PoolKind:
            for half in Half:
                tag = LaunchTag(point, pool, half)
                assert tag.value == point * 4 + pool * 2 + half
                assert LaunchTag.decode(tag.value) == tag
                assert str(tag) == f"{point.name}.{pool.name}.{half.name}"
                seen.add(tag.value)
    assert seen == set(range(NUM_LAUNCH_TAGS)) and NUM_LAUNCH_TAGS == 12
    assert LaunchTag(LaunchPoint.TAIL).value == 4


@pytest.mark.parametrize("value", [-1, 12, 100])
def test_launch_tag_decode_out_of_range(value):
    with pytest.raises(ValueError, match=rf"launch tag {value} out of range \[0, 12\)"):
        LaunchTag.decode(value)


def test_violation_row_from_row():
    tag = LaunchTag(LaunchPoint.SWEEP, PoolKind.SWA, Half.V)
    row = ViolationRow.from_row([tag.value, 17, 3, 501, 502, -5, 2**63 - 1, 1 | 32])
    assert row == ViolationRow(tag, 17, 3, 501, 502, -5, 2**63 - 1, Reason.CHAIN | Reason.VERIFY_TOKEN)
    with pytest.raises(ValueError, match="violation row length 7 != 8"):
        ViolationRow.from_row([0] * 7)
    with pytest.raises(ValueError, match="launch tag 12 out of range"):
        ViolationRow.from_row([12] + [0] * 7)


def test_violation_row_source_mask_above_the_launch_tag():
    """A fingerprint row: the launch tag in the low 8 bits, the differing sources' mask above."""
    tag = LaunchTag(LaunchPoint.TAIL, PoolKind.FULL, Half.V)
    row = ViolationRow.from_row([tag.value | 0b1010 << 8, 9, 4, 7, -1, 11, 12, int(Reason.FINGERPRINT)])
    assert (row.tag, row.sources_mask, row.source_indices) == (tag, 0b1010, (1, 3))
    assert ViolationRow.from_row([tag.value, 9, 4, 7, -1, 11, 12, 4]).source_indices == ()


def test_decode_rows():
    rows = torch.tensor([[0, 5, 1, 2, 2, 9, 8, 1], [4, -1, -1, -1, -1, -1, -1, 3]])
    got = decode_rows(rows)
    assert [r.slot for r in got] == [5, -1]
    assert got[1].tag == LaunchTag(LaunchPoint.TAIL) and got[1].reasons == Reason.CHAIN | Reason.POSITION
    assert decode_rows(torch.zeros(0, 8, dtype=torch.int64)) == []


def test_new_canary_and_record_words():
    canary = new_canary(5)
    assert canary.dtype == torch.uint8 and canary.shape == (5, RECORD_BYTES) and not canary.any()
    words = record_words(canary)
    assert words.dtype == torch.int64 and words.shape == (5, 4)
    words[2, 1] = 0x0102030405060708  # little-endian fields sharing the buffer's storage
    assert canary[2, 8:16].tolist() == [8, 7, 6, 5, 4, 3, 2, 1]
    with pytest.raises(ValueError, match="num_slots 1 < 2"):
        new_canary(1)


def test_new_ring_and_stats_shapes():
    ring, counter = new_ring(3)
    assert ring.shape == (3, VIOLATION_ROW_WIDTH) and ring.dtype == torch.int64 and bool((ring == -1).all())
    assert counter.shape == (1,) and counter.dtype == torch.int64 and int(counter) == 0
    stats = new_stats()
    assert stats.shape == (NUM_LAUNCH_TAGS, NUM_STATS) and stats.dtype == torch.int64 and not stats.any()
    with pytest.raises(ValueError, match="ring capacity 0 < 1"):
        new_ring(0)
