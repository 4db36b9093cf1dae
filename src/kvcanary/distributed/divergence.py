"""``rank_divergence``: ranks that should hold the same KV-cache content disagree.

Decoded from the agreed signal table (``signal.py``), the same on every rank, by a pure function:

| cause        | when                                                                          |
|--------------|-------------------------------------------------------------------------------|
| violations   | some ranks reported violations in the step and others did not; ``ranks`` are  |
|              | the reporting ones, ``detail`` their reasons and launch points                |
| chain_digest | the ranks' chain digests differ; ``ranks`` hold a digest other than the most  |
|              | common one (on a tie, other than rank 0's)                                    |

The line is frozen; parse it with ``DIVERGENCE_RE``::

    kv_canary rank_divergence: rank=0 step=31 cause=violations ranks=1 world=2 detail=1:chain+position@HEAD(2)

(``rank``: the rank that logged it; every rank logs the same divergence.)
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvcanary.core.record import format_reasons
from kvcanary.distributed.signal import CODE, DIGEST, ROWS, decode_code

DIVERGENCE_RE = re.compile(
    r"^kv_canary rank_divergence: rank=(?P<rank>\d+) step=(?P<step>-?\d+) cause=(?P<cause>violations|chain_digest) "
    r"ranks=(?P<ranks>[\d,]+) world=(?P<world>\d+) detail=(?P<detail>\S*)$")


class Cause(enum.Enum):
    VIOLATIONS = "violations"
    CHAIN_DIGEST = "chain_digest"


@dataclass(frozen=True)
class RankSignal:
    """One rank's row of the agreed table, decoded."""

    rank: int
    rows: int
    code: int
    digest: int

    def describe(self) -> str:
        """``chain+position@HEAD(2)``: reasons @ launch points (violation rows)."""
        reasons, points, alarm = decode_code(self.code)
        where = "+".join(p.name for p in points) or "-"
        return f"{format_reasons(reasons)}@{where}({self.rows})" + ("+watchdog" if alarm else "")

    def to_json(self) -> dict:
        reasons, points, alarm = decode_code(self.code)
        return {"rank": self.rank, "violation_rows": self.rows, "reasons": format_reasons(reasons).split("+"),
                "launch_points": [p.name for p in points], "watchdog_alarm": alarm,
                "digest": f"0x{self.digest & (2**64 - 1):016x}"}


@dataclass(frozen=True)
class RankDivergence:
    """One divergence of step ``step``: ``ranks`` (sorted) are the odd ones out of ``world``;
    ``detail`` per rank of the table: its violation rows, reasons, launch points and digest;
    ``observer``: the rank that decoded it."""

    step: int
    cause: Cause
    ranks: tuple[int, ...]
    world: int
    detail: tuple[RankSignal, ...]
    observer: int = 0

    def line(self) -> str:
        if self.cause is Cause.VIOLATIONS:
            detail = ",".join(f"{d.rank}:{d.describe()}" for d in self.detail if d.rank in self.ranks)
        else:
            detail = ",".join(f"{d.rank}:0x{d.digest & (2**64 - 1):016x}" for d in self.detail)
        return (f"kv_canary rank_divergence: rank={self.observer} step={self.step} cause={self.cause.value} "
                f"ranks={','.join(map(str, self.ranks))} world={self.world} detail={detail}")

    def to_json(self) -> dict:
        return {"step": self.step, "reason": "rank_divergence", "observer": self.observer, "cause": self.cause.value,
                "ranks": list(self.ranks), "world": self.world, "per_rank": [d.to_json() for d in self.detail]}


def find_divergences(step: int, table: Sequence[Sequence[int]], observer: int = 0) -> list[RankDivergence]:
    """The divergences of one agreed table (``int64[world, SIGNAL_WIDTH]`` as nested lists), as
    decoded by rank ``observer``."""
    world = len(table)
    detail = tuple(RankSignal(r, int(row[ROWS]), int(row[CODE]), int(row[DIGEST])) for r, row in enumerate(table))
    out = []
    reporting = tuple(d.rank for d in detail if d.rows > 0)
    if 0 < len(reporting) < world:
        out.append(RankDivergence(step, Cause.VIOLATIONS, reporting, world, detail, observer))
    digests = Counter(d.digest for d in detail)
    if len(digests) > 1:
        top = max(digests.values())
        common = detail[0].digest if digests[detail[0].digest] == top else digests.most_common(1)[0][0]
        odd = tuple(d.rank for d in detail if d.digest != common)
        out.append(RankDivergence(step, Cause.CHAIN_DIGEST, odd, world, detail, observer))
    return out
