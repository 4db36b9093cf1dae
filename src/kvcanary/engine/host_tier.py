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


class HostTier:
    def __init__(self, pool: KVPool, tree: RadixCache, num_rows: int, stats: EngineStats):
        self.pool, self.tree, self.num_rows, self.stats = pool, tree, num_rows, stats
        self._free_rows = deque(range(num_rows))

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
        self.pool.copy_to_host(node.slots, rows)
        return rows

    def load(self, node: RadixNode, slots: torch.Tensor) -> None:
        """Copy host ``node`` into device ``slots`` (int64[len(key)], freshly allocated), free its
        host rows and make it a device node."""
        assert node.is_on_host and slots.numel() == len(node.key), f"bad load of {node}"
        self.pool.copy_from_host(node.host_rows, slots)
        self.free_rows(node.host_rows)
        node.slots, node.host_rows = slots.to("cpu", torch.int64), None

    def check_integrity(self) -> None:
        """Assert every host row is free or held by exactly one host node."""
        held = [n.host_rows for n in self.tree.nodes() if n.is_on_host]
        rows = (torch.cat(held).tolist() if held else []) + list(self._free_rows)
        assert sorted(rows) == list(range(self.num_rows)), (
            f"host row conservation broken: {len(self._free_rows)} free + {len(rows) - len(self._free_rows)} "
            f"held != {self.num_rows}, or a row is held twice / out of range"
        )
