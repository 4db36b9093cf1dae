"""The 32-byte canary record, fail reasons, launch tags and the violation row.

A canary buffer is ``uint8[num_slots, 32]``, index-aligned with the KV pool's slots and
zero-initialised. Slot 0 is reserved for padding writes and is never verified. A record is
four little-endian int64 fields:

| word | field       | meaning                                                   |
|------|-------------|-----------------------------------------------------------|
| 0    | token       | token id whose K/V the slot holds                         |
| 1    | position    | logical position of that token in its sequence            |
| 2    | chain       | prefix hash entering this slot (see core.hashing)         |
| 3    | fingerprint | hash of the slot's real K/V bytes (0 when not recorded)   |

Beside the records, ``int64[num_slots]`` *source tags* (one side word per slot, written with the
fingerprint word) hold 16 bits of each KV source's own part of the fingerprint: source i in bits
``16i .. 16i + 15``. They are not part of any check; when a fingerprint mismatches they name the
sources whose part changed (``SourceMask`` in a violation row's tag column).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

RECORD_BYTES = 32
RECORD_WORDS = 4
ROW_BYTES = RECORD_BYTES + 8  # a record that travels with its K/V: the 32 bytes, then its source-tag side word
RECORD_VERSION = 1  # the layout of a record and its side word; moved rows carry it (runtime.signature)
TOKEN, POSITION, CHAIN, FINGERPRINT = range(RECORD_WORDS)
PAD_SLOT = 0


def new_canary(num_slots: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed canary buffer ``uint8[num_slots, 32]``."""
    if num_slots < 2:
        raise ValueError(f"num_slots {num_slots} < 2; slot 0 is reserved, so a pool needs at least 2 slots")
    return torch.zeros(num_slots, RECORD_BYTES, dtype=torch.uint8, device=device)


def record_words(canary: torch.Tensor) -> torch.Tensor:
    """The ``int64[num_slots, 4]`` view of a canary buffer (shares storage)."""
    return canary.view(torch.int64)


class Reason(enum.IntFlag):
    """Fail-reason bits of a violation row."""

    CHAIN = 1
    POSITION = 2
    FINGERPRINT = 4
    WRITE_TOKEN = 8
    WRITE_POSITION = 16
    VERIFY_TOKEN = 32
    BAD_ENTRY = 64  # a page-table / window-table entry or a write target that resolves to no slot
    WRITE_CONFLICT = 128  # two tokens of one forward write the same slot
    READ_CONFLICT = 256  # a forward writes a slot a request of the batch reads (or the prefix cache holds)
    MISSED_WRITE = 512  # a write target still holds HEAD's mark at TAIL: the forward did not write it

    @classmethod
    def names(cls, bits: int) -> list[str]:
        return [r.name.lower() for r in cls if bits & r.value]

    @classmethod
    def parse(cls, text: str) -> Reason:
        """Inverse of ``format_reasons``: ``"chain+position"`` -> Reason.CHAIN | Reason.POSITION."""
        out = cls(0)
        for part in filter(None, text.split("+")):
            try:
                out |= cls[part.upper()]
            except KeyError:
                raise ValueError(f"unknown reason {part!r}; expected one of {[r.name.lower() for r in cls]}") from None
        return out


def format_reasons(bits: int) -> str:
    return "+".join(Reason.names(bits)) or "none"


class LaunchPoint(enum.IntEnum):
    HEAD = 0
    TAIL = 1
    SWEEP = 2


class Half(enum.IntEnum):
    K = 0
    V = 1


class PoolKind(enum.IntEnum):
    FULL = 0
    SWA = 1


class FingerprintMode(enum.IntEnum):
    """What a record's fingerprint folds of its slot's K/V: nothing, the first 16 bytes of each
    source row (PARTIAL), or the whole row (ALL)."""

    NONE = 0
    PARTIAL = 1
    ALL = 2


MAX_SOURCES = 4  # KV sources one fingerprint folds (the kernels take four buffers)


NUM_LAUNCH_TAGS = len(LaunchPoint) * len(PoolKind) * len(Half)
SOURCE_TAG_BITS = 16  # bits of each source's part in the side word
_SOURCE_BITS = 0xFF  # a row names at most 8 sources (the kernels take 4)
SOURCE_MASK_SHIFT = 8  # a violation row's tag column: launch tag | source mask << 8
LAUNCH_TAG_MASK = (1 << SOURCE_MASK_SHIFT) - 1


@dataclass(frozen=True)
class LaunchTag:
    """Where a check ran: launch point x pool kind x K/V half, packed into one int.

    ``value = point * 4 + pool * 2 + half``. Identity checks (chain, position, token) run once
    per pool and carry the half of the pool's first source (K when none); a fingerprint mismatch
    carries the half of the first source whose part of the fingerprint differs (the first
    source's when none does: a side word never written, or a 2**-16 collision of the parts).
    """

    point: LaunchPoint
    pool: PoolKind = PoolKind.FULL
    half: Half = Half.K

    @property
    def value(self) -> int:
        return int(self.point) * 4 + int(self.pool) * 2 + int(self.half)

    @classmethod
    def decode(cls, value: int) -> LaunchTag:
        if not 0 <= value < NUM_LAUNCH_TAGS:
            raise ValueError(f"launch tag {value} out of range [0, {NUM_LAUNCH_TAGS})")
        return cls(LaunchPoint(value // 4), PoolKind((value // 2) % 2), Half(value % 2))

    def __str__(self) -> str:
        return f"{self.point.name}.{self.pool.name}.{self.half.name}"


# --- violation rows ----------------------------------------------------------------------

VIOLATION_ROW_WIDTH = 8  # the tag column holds the launch tag in its low 8 bits, a source mask above
(COL_TAG, COL_SLOT, COL_STORED_POSITION, COL_STORED_TOKEN, COL_EXPECTED_TOKEN, COL_STORED_VALUE,
 COL_EXPECTED_VALUE, COL_REASONS) = range(VIOLATION_ROW_WIDTH)


@dataclass(frozen=True)
class ViolationRow:
    """One decoded ring row.

    ``stored_value`` / ``expected_value`` belong to the first failing check in the order
    chain, position, fingerprint, write_token/verify_token: the stored and expected chain for a
    chain failure, the stored and expected position for a position failure, and so on.

    Rows of the per-forward checks that name a request carry its page-table row instead:

    | reason         | slot                     | stored_position | stored_token  | stored_value | expected_value    |
    |----------------|--------------------------|-----------------|---------------|--------------|-------------------|
    | BAD_ENTRY      | the entry as given (page | the position    | -1 (read) or  | page-table   | what the entry    |
    |                | table / out_cache_loc)   |                 | written token | row          | resolved to       |
    | WRITE_CONFLICT | the slot                 | written position| written token | writer's row | first writer's row|
    | READ_CONFLICT  | the slot                 | written position| written token | writer's row | first reader's row|
    | MISSED_WRITE   | the slot (translated)    | written position| written token | sources still| 0                 |
    |                |                          |                 |               | marked (bits)|                   |

    BAD_ENTRY: the entry resolves to the padding slot 0, a negative slot, a slot outside the
    pool, or (window pools) a full slot the window table does not map. ``expected_token`` is the
    truth token at that position (or the expected written token), -1 when unknown.

    ``sources_mask`` (tag column >> 8): for a FINGERPRINT failure, bit i is set when source i's
    part of the fingerprint differs from the slot's side word; 0 for every other row.

    MISSED_WRITE (TAIL, ``ops.landed``): the first 16 bytes of the slot's row still hold the mark
    HEAD wrote in the sources of bit i of ``stored_value`` (bit i = the i-th covered source); the
    tag's half is that of the first such source; ``expected_token`` is -1.
    """

    tag: LaunchTag
    slot: int
    stored_position: int
    stored_token: int
    expected_token: int
    stored_value: int
    expected_value: int
    reasons: Reason
    sources_mask: int = 0

    @classmethod
    def from_row(cls, row: list[int]) -> ViolationRow:
        if len(row) != VIOLATION_ROW_WIDTH:
            raise ValueError(f"violation row length {len(row)} != {VIOLATION_ROW_WIDTH}")
        tag = row[COL_TAG]
        return cls(LaunchTag.decode(tag & LAUNCH_TAG_MASK if tag >= 0 else tag), *row[COL_SLOT:COL_REASONS],
                   Reason(row[COL_REASONS]), max(tag, 0) >> SOURCE_MASK_SHIFT)

    @property
    def source_indices(self) -> tuple[int, ...]:
        """Indices of the KV sources the row names: for a FINGERPRINT failure those whose part
        differs (``sources_mask``'s bits), for a MISSED_WRITE those still holding HEAD's mark
        (``stored_value``'s bits)."""
        mask = self.sources_mask
        if not mask and self.reasons & Reason.MISSED_WRITE and self.stored_value > 0:
            mask = self.stored_value & _SOURCE_BITS
        return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def new_ring(capacity: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A violation ring ``int64[capacity, 8]`` and its total counter ``int64[1]``.

    Kernels claim a row with one atomic add on the counter; rows past ``capacity`` are dropped
    but still counted, so ``counter - capacity`` is the number lost.
    """
    if capacity < 1:
        raise ValueError(f"ring capacity {capacity} < 1")
    ring = torch.full((capacity, VIOLATION_ROW_WIDTH), -1, dtype=torch.int64, device=device)
    return ring, torch.zeros(1, dtype=torch.int64, device=device)


STAT_LAUNCHES, STAT_CHECKED, STAT_STAMPED = range(3)
NUM_STATS = 3


def new_stats(device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-tag counters ``int64[NUM_LAUNCH_TAGS, 3]``: launches, slots checked, slots stamped."""
    return torch.zeros(NUM_LAUNCH_TAGS, NUM_STATS, dtype=torch.int64, device=device)


def decode_rows(rows: torch.Tensor) -> list[ViolationRow]:
    """Decode ``int64[n, 8]`` ring rows (any device) into ``ViolationRow`` objects."""
    return [ViolationRow.from_row(r) for r in rows.cpu().tolist()]
