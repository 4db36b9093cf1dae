"""Host index mismatch on load-back: a slot is loaded from another evicted node's host row (an
offload or load-back that computes the wrong host index, TensorRT-LLM#8813).

After TAIL of step k, the contents of a host row that a waiting request will load back (node A,
see ``_host_tier``) and of a row of another host-resident node B are swapped, K/V of every layer
and the canary's host mirror (``Canary.host_rows``) together: whichever of A or B is loaded
back first gets a slot whose K/V and record both belong to the other node's row, exactly what
a load from the wrong index delivers. The fingerprint matches (bytes and record moved
together), so only identity checks can see it.

First seen at SWEEP, not at HEAD: the load-back is verified at once (``verify_landed``, tagged
SWEEP), and it checks every landed slot against the one landed before it. The wrong record
breaks that link (chain, at the wrong slot, or at its successor when it landed first) and, when
the two rows sit at different positions, the position (position). The HEAD of the request that
loaded the node reports chain in the same step, after the sweep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults._host_tier import HostRowFault
from kvcanary.faults.base import Expectation

if TYPE_CHECKING:
    from kvcanary.engine.radix import RadixNode


class HostRowMismatch(HostRowFault):
    name = "host_row_mismatch"
    expected = Expectation(LaunchPoint.SWEEP, Reason.CHAIN, Reason.POSITION)

    def damage(self, step: int, targets: list[tuple[RadixNode, list[int]]]) -> None:
        node_a, rows_a = targets[0]  # the front-most waiting request loads it first
        i = self.rng.randrange(len(rows_a))
        row_a = rows_a[i]
        mirror = self.canary.host_rows if self.canary is not None else None
        others = [(n, j, r) for n in self.engine.tree.nodes() if n.is_on_host and n is not node_a
                  for j, r in enumerate(n.host_rows.tolist())]
        if mirror is not None and others:  # a row holding the very same record would be harmless
            differs = (mirror[[r for _, _, r in others]] != mirror[row_a]).any(1).tolist()
            others = [o for o, d in zip(others, differs, strict=True) if d]
        if not others:
            self.skip(step, "needs a row of a second host-resident node that differs from the target row")
            return
        node_b, j, row_b = self.rng.choice(others)
        pool = self.engine.pool
        for buf, dim in ((pool.host_k, 1), (pool.host_v, 1)) + (((mirror, 0),) if mirror is not None else ()):
            a, b = buf.select(dim, row_a), buf.select(dim, row_b)
            held = a.clone()
            a.copy_(b)
            b.copy_(held)
        # the landed run is checked slot against slot: every row after the wrong one may fail
        affected = node_a.host_rows[i:].tolist() + node_b.host_rows[j:].tolist()
        self.record_rows(step, f"host_row={row_a} (position {node_a.start + i}) <-> host_row={row_b} "
                               f"(position {node_b.start + j} of another node): K/V and records swapped",
                         {row_a, row_b}, affected)
