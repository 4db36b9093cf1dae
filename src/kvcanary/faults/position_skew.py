"""Position skew: one request's positions are off by ``offset`` (default +1) for one forward (a
stale position buffer, an off-by-one in a prefix length).

Before HEAD, every position of one request's extend is raised by ``offset``: the model applies
RoPE at the wrong positions and HEAD stamps the wrong positions. HEAD's write check compares
each written position with ``prefix_len + j`` and reports write_position for every written
slot. Later reads report position on those slots (their chain links hold: the stamp chained
the positions it was given), and the request's next write reports write_position again, since
its predecessor's stored position + 1 is not its position. Its later slots are chained from the
skewed positions: where they meet a clean copy of the prefix in the prefix cache, the seam
fails a link (chain; see ``_follow``).
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.errors import ConfigError
from kvcanary.faults._follow import SequenceFault
from kvcanary.faults.base import Expectation
from kvcanary.runtime.batch import ForwardBatch


class PositionSkew(SequenceFault):
    """``request_id``: the request whose positions are skewed (None: a random one of the batch);
    ``offset``: added to each of its positions (not 0)."""

    name = "position_skew"
    expected = Expectation(LaunchPoint.HEAD, Reason.WRITE_POSITION)

    def __init__(self, *, request_id: int | None = None, offset: int = 1, **gate):
        super().__init__(**gate)
        if offset == 0:
            raise ConfigError("PositionSkew offset must not be 0 (that skews nothing); use e.g. 1")
        self.request_id, self.offset = request_id, offset

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        victims = [r for r in self.batch_requests(batch) if r[3] > 0 and self.request_id in (None, r[1])]
        if not victims:
            self.skip(step, "no target request writes in this forward")
            return
        i, rid, prefix, extend = self.rng.choice(victims)
        start = int((batch.extend_lens[:i]).sum())
        batch.positions[start : start + extend] += self.offset
        slots = batch.out_cache_loc[start : start + extend].tolist()
        inj = self.record(step, slots[0], f"request={rid} positions {prefix}..{prefix + extend - 1} written as "
                                          f"{prefix + self.offset}..{prefix + extend - 1 + self.offset}", set(slots))
        self.follow(inj, rid, prefix)
