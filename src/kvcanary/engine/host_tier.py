"""Host offload tier: evicted prefix-cache nodes keep their K/V in host rows.

One host row holds one slot's K and V for every layer (storage: ``KVPool.host_k/host_v``).
``offload`` copies a device node out (through ``KVPool.copy_to_host``), ``load`` copies a host
node back into fresh device slots (``KVPool.copy_from_host``). When the tier is full, the least
recently used unlocked host leaves are dropped from the tree to make room.
"""

from __future__ import annotations

from collections import deque

import torch

from kvcanary.engine.pool import KVPool
from kvcanary.engine.radix import RadixCache, RadixNode
from kvcanary.engine.stats import EngineStats
from kvcanary.engine.zoo import Bug, Zoo


class HostTier:
    def __init__(self, pool: KVPool, tree: RadixCache, num_rows: int, stats: EngineStats, zoo: Zoo | None = None):
        self.pool, self.tree, self.num_rows, self.stats = pool, tree, num_rows, stats
        self.zoo = zoo if zoo is not None else Zoo()
        self._free_rows = deque(range(num_rows))
        self._num_loads = 0
        # zoo (Bug.LOAD_BACK_UNORDERED): offloads of the current step, their copies unfinished
        self.in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def free_rows(self, rows: torch.Tensor) -> None:
        """Return host rows to the tier (they hold nothing useful any more)."""
        self._free_rows.extend(rows.tolist())

    def _drop_lru_leaf(self) -> bool:
        leaves = [n for n in self.tree.nodes() if n.is_on_host and not n.children and n.lock_count == 0]
        if not leaves:
            return False
        victim = min(leaves, key=lambda n: n.last_access)
        _, rows = self.tree.remove(victim)
        self.free_rows(rows)
        self.stats.num_dropped_host_slots += rows.numel()
        return True

    def offload(self, node: RadixNode) -> torch.Tensor | None:
        """Copy device ``node``'s K/V to host rows and return them (int64, CPU), dropping LRU host
        leaves when full; None when it cannot fit. Does not change ``node``: the tree does."""
        size = len(node.key)
        if size > self.num_rows:
            return None
        while len(self._free_rows) < size:
            if not self._drop_lru_leaf():
                return None
        rows = torch.tensor([self._free_rows.popleft() for _ in range(size)], dtype=torch.int64)
        if Bug.OFFLOAD_SHARED_HOST_ROW in self.zoo and size >= 2:
            # zoo: the row cursor is read twice before it advances: the last two slots share a row
            self._free_rows.appendleft(int(rows[-1]))
            rows[-1] = rows[-2]
            self.zoo.record(Bug.OFFLOAD_SHARED_HOST_ROW, f"slots {node.slots[-2:].tolist()} both offloaded "
                            f"into host row {int(rows[-1])}", node.slots[-2:], rows[-1:])
        self.pool.copy_to_host(node.slots, rows)
        if Bug.LOAD_BACK_UNORDERED in self.zoo:
            self.in_flight.append((node.slots.clone(), rows))
        return rows

    def load(self, node: RadixNode, slots: torch.Tensor) -> None:
        """Copy host ``node`` into device ``slots`` (int64[len(key)], freshly allocated), free its
        host rows and make it a device node."""
        assert node.is_on_host and slots.numel() == len(node.key), f"bad load of {node}"
        self._num_loads += 1
        if Bug.FAILED_LOAD_COUNTED in self.zoo and self._num_loads % 2 == 1:
            # zoo: the read failed (nothing reached the device), but the node counts as loaded
            self.zoo.record(Bug.FAILED_LOAD_COUNTED, f"load of {node} into slots {slots.tolist()[:8]}... failed",
                            slots, node.host_rows)
        else:
            self.pool.copy_from_host(node.host_rows, slots)
        if Bug.LOAD_BACK_UNORDERED in self.zoo:
            self._race_in_flight_offloads(slots)
        self.free_rows(node.host_rows)
        node.slots, node.host_rows = slots.to("cpu", torch.int64), None

    def _race_in_flight_offloads(self, slots: torch.Tensor) -> None:
        """Zoo (``Bug.LOAD_BACK_UNORDERED``): offloads of this step still read slots the load-back
        just wrote: their host rows get the loaded K/V (their records stay)."""
        pool, dev_slots = self.pool, slots.to("cpu", torch.int64)
        for src, rows in self.in_flight:
            hit = torch.isin(src, dev_slots)
            if not bool(hit.any()):
                continue
            src_hit, rows_hit = src[hit].to(pool.device), rows[hit]
            pool.host_k[:, rows_hit] = torch.stack([k[src_hit] for k in pool.k_buffers]).cpu()
            pool.host_v[:, rows_hit] = torch.stack([v[src_hit] for v in pool.v_buffers]).cpu()
            self.zoo.record(Bug.LOAD_BACK_UNORDERED, f"offload of slots {src[hit].tolist()[:8]} read them after "
                            f"the load-back wrote them", src[hit], rows_hit)

    def check_integrity(self) -> None:
        """Assert every host row is free or held by exactly one host node."""
        held = [n.host_rows for n in self.tree.nodes() if n.is_on_host]
        rows = (torch.cat(held).tolist() if held else []) + list(self._free_rows)
        assert sorted(rows) == list(range(self.num_rows)), (
            f"host row conservation broken: {len(self._free_rows)} free + {len(rows) - len(self._free_rows)} "
            f"held != {self.num_rows}, or a row is held twice / out of range"
        )
