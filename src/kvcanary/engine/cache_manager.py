"""The cache manager owns the KV memory of requests: pool, prefix cache and host tier together.

It gives a request its row and cached prefix (``admit``), grows its slots (``reserve``) and
takes everything back (``release``), evicting from the prefix cache (offloading to the host
tier when there is one) whenever the free list is short.

With a window pool (sliding-window layers), ``reserve`` gives the positions about to be written
a window slot. Window slots are taken back lazily, when the window pool is short: first the
positions that slid out of a running request's window (older than ``num_cached - window``; the
latest first, so prompts, where prefixes are shared, keep theirs longest), then those of
prefix-cache nodes no request reads (their full K/V stays cached). The host tier carries window
K/V too. A cached prefix is reused only up to a length whose last ``window`` positions have
window K/V (after load-back); the rest is recomputed.

Quarantine (``quarantine``): damaged pages leave the prefix cache and the host tier at once; the
requests still reading them keep them until they end, and nothing of them is cached again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.engine.host_tier import HostTier
from kvcanary.engine.pool import KVPool
from kvcanary.engine.radix import RadixCache, RadixNode
from kvcanary.engine.request import Request
from kvcanary.engine.stats import EngineStats
from kvcanary.engine.zoo import Bug, Zoo


class CacheManager:
    def __init__(self, pool: KVPool, tree: RadixCache | None, host_tier: HostTier | None, stats: EngineStats,
                 zoo: Zoo | None = None):
        self.pool, self.tree, self.host_tier, self.stats = pool, tree, host_tier, stats
        self.zoo = zoo if zoo is not None else Zoo()
        self.page_size = pool.page_size
        self._window_users: dict[int, Request] = {}  # request id -> request holding own window slots

    def evict(self, num_slots: int) -> int:
        """Evict at least ``num_slots`` unlocked prefix-cache slots if possible; returns the number freed.
        Side effects: ``on_offload`` per offloaded node, then ``on_free``."""
        if self.tree is None:
            return 0
        evicted = self.tree.evict(num_slots, self.host_tier.offload if self.host_tier else None)
        self.pool.free(evicted.slots)
        if self.host_tier is not None:
            self.host_tier.free_rows(evicted.host_rows)
        self.stats.num_dropped_host_slots += evicted.host_rows.numel()
        self.stats.num_evicted_slots += evicted.slots.numel()
        self.stats.num_offloaded_slots += evicted.num_offloaded
        return evicted.slots.numel()

    def begin_step(self) -> None:
        """A new step: the copies of the last one have finished."""
        if self.host_tier is not None:
            self.host_tier.in_flight.clear()

    def alloc_slots(self, num_slots: int) -> torch.Tensor | None:
        """``num_slots`` (a page multiple) fresh slots, evicting from the prefix cache when short."""
        short = num_slots - self.pool.num_free_slots
        if short > 0:
            self.evict(short)
        return self.pool.alloc(num_slots)

    def _window_prefix(self, node: RadixNode, on_host: bool = False) -> int:
        """The longest page-aligned prefix length P <= ``node.end`` whose positions
        ``[P - window, P)`` have window K/V: in window slots, or (``on_host``) in host rows that
        hold it and come back with a load. A sliding-window layer reads them."""
        window, pool, ps = self.pool.window, self.pool, self.page_size
        flags = [pool.host_has_window[n.host_rows] if n.is_on_host and on_host
                 else torch.zeros(len(n.key), dtype=torch.bool) if n.is_on_host
                 else window.translate(n.slots) != 0 for n in node.path()]
        if not flags:
            return 0
        missing = torch.nonzero(~torch.cat(flags)).flatten().tolist()
        for end in range(node.end // ps * ps, 0, -ps):
            # the last missing position before ``end`` must lie before the window
            before = [m for m in missing if m < end]
            if not before or before[-1] < end - window.window:
                return end
        return 0

    def _unlock(self, node: RadixNode) -> None:
        """Drop a lock of ``node``; free the slots of quarantined nodes whose last lock it was."""
        released = self.tree.unlock(node)
        if released.numel():
            self.pool.free(released)

    def _rematch(self, node: RadixNode, tokens: list[int], length: int) -> tuple[RadixNode, int]:
        """Unlock ``node`` and lock the prefix of ``tokens`` of ``length`` instead (splitting a node)."""
        self._unlock(node)
        node, length = self.tree.match(tokens[:length])
        self.tree.lock(node)
        return node, length

    def _match_and_lock(self, tokens: list[int]) -> tuple[RadixNode | None, int]:
        """Lock the longest cached prefix of ``tokens`` that leaves at least one token to compute,
        loading host nodes back to the device; stops before a node that cannot be loaded. With a
        window pool, cut where the window K/V before the cut is resident (after the loads)."""
        if self.tree is None:
            return None, 0
        limit = (len(tokens) - 1) // self.page_size * self.page_size
        node, length = self.tree.match(tokens[:limit])
        self.tree.lock(node)  # protects the path (host nodes too) from eviction while loading
        if self.pool.window is not None and (cut := self._window_prefix(node, on_host=True)) < length:
            node, length = self._rematch(node, tokens, cut)
        for n in node.path():
            if not n.is_on_host:
                continue
            slots = self.alloc_slots(len(n.key))
            if slots is None:
                self._unlock(node)
                node = n.parent
                self.tree.lock(node)
                length = node.end
                break
            self.host_tier.load(n, slots)
            self.stats.num_loaded_slots += slots.numel()
        if self.pool.window is not None and (cut := self._window_prefix(node)) < length:
            node, length = self._rematch(node, tokens, cut)  # a load found the window pool short
        return node, length

    def admit(self, req: Request) -> bool:
        """Give ``req`` a page-table row and its cached prefix. False (nothing held) when no row is free.
        Side effects: may evict/offload and load back (``on_offload``, ``on_free``, ``on_load``)."""
        row = self.pool.alloc_row()
        if row is None:
            return False
        node, length = self._match_and_lock(req.token_ids)
        req.row, req.prefix_node, req.truth_len = row, node, 0  # a new row holds none of its history
        req.num_cached = req.num_prefix_cached = length
        req.slots = torch.cat([n.slots for n in node.path()]) if length else req.slots[:0]
        self.pool.req_to_token[row, :length] = req.slots.to(self.pool.device, torch.int32)
        return True

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make positions ``[0, num_tokens)`` of ``req`` have slots; False (nothing taken) if memory
        is short even after eviction."""
        need = -(-num_tokens // self.page_size) * self.page_size - req.capacity
        slots = self.alloc_slots(need) if need > 0 else None  # evicting first: freed slots free window slots
        if need > 0 and slots is None:
            return False
        window = self.pool.window
        if window is not None:
            self._window_users[req.request_id] = req
            num_new = max(need, 0) + window.num_unmapped(req.slots[req.num_cached : num_tokens])
            if not self._free_window_slots(num_new):
                if slots is not None:
                    self.pool.free(slots)
                return False
        if slots is not None:
            self._extend(req, slots)
        if window is not None:
            mapped = window.map(req.slots[req.num_cached : num_tokens])
            assert mapped, f"window pool short after checking: {window.num_free_slots} free"
        return True

    def _free_window_slots(self, num_slots: int) -> bool:
        """At least ``num_slots`` free window slots: take back the slid-out positions of running
        requests, then the window slots of prefix-cache nodes no request reads (least recently used
        first); False if still short."""
        window = self.pool.window
        if window.num_free_slots >= num_slots:
            return True
        # slid-out own positions of running requests, latest first: the earlier ones (prompts, where
        # prefixes are shared) keep their window slots longest
        positions, slots = [], []
        for req in self._window_users.values():
            end = req.num_cached - window.window
            if end > req.num_prefix_cached:
                positions.append(torch.arange(req.num_prefix_cached, end))
                slots.append(req.slots[req.num_prefix_cached : end])
        if slots:
            positions, slots = torch.cat(positions), torch.cat(slots)
            mapped = window.translate(slots) != 0
            order = torch.argsort(positions[mapped], descending=True, stable=True)
            window.unmap(slots[mapped][order][: num_slots - window.num_free_slots], slid=True)
        if window.num_free_slots >= num_slots or self.tree is None:
            return window.num_free_slots >= num_slots
        idle = [n for n in self.tree.nodes() if n.lock_count == 0 and not n.is_on_host]
        for node in sorted(idle, key=lambda n: n.last_access):
            if window.num_free_slots >= num_slots:
                break
            window.unmap(node.slots, dropped=True)
        return window.num_free_slots >= num_slots

    def _extend(self, req: Request, slots: torch.Tensor) -> None:
        need = slots.numel()
        self.pool.req_to_token[req.row, req.capacity : req.capacity + need] = slots.to(
            self.pool.device, torch.int32
        )
        if Bug.PREFIX_PAGE_OFF_BY_ONE in self.zoo and req.capacity == req.num_prefix_cached == self.page_size:
            self._continue_last_prefix_page(req, int(slots[0]))
        req.slots = torch.cat([req.slots, slots])

    def _continue_last_prefix_page(self, req: Request, own_slot: int) -> None:
        """Zoo (``Bug.PREFIX_PAGE_OFF_BY_ONE``): a one-page prefix is taken for a page with room
        (``prefix_len <= page_size``): position page_size goes to the slot after the last prefix
        slot; ``own_slot``, the one allocated for it, is never written."""
        slot = int(req.slots[-1]) + 1
        if slot < self.pool.num_slots:
            self.pool.req_to_token[req.row, req.capacity] = slot
            self.zoo.record(Bug.PREFIX_PAGE_OFF_BY_ONE, f"request={req.request_id} position {req.capacity} -> "
                            f"slot {slot} (the next physical page) instead of {own_slot}", [slot, slot + 1, own_slot],
                            request_id=req.request_id, positions=[req.capacity])

    def trim(self, req: Request) -> None:
        """Free ``req``'s own pages past its tokens (the slots of rejected speculative drafts)."""
        keep = max(-(-req.num_tokens // self.page_size) * self.page_size, req.num_prefix_cached)
        if req.capacity > keep:
            self.pool.free(req.slots[keep:])
            self.pool.req_to_token[req.row, keep : req.capacity] = 0
            req.slots = req.slots[:keep]

    def release(self, req: Request, cache: bool) -> None:
        """Take back everything ``req`` holds. With ``cache``, its computed page-aligned tokens
        enter the prefix cache; its other own slots are freed (``on_free``)."""
        own_start = req.num_prefix_cached
        if cache and self.tree is not None:
            num_cached = req.num_cached // self.page_size * self.page_size
            if Bug.REJECTED_DRAFT_KV_CACHED in self.zoo:
                num_cached = self._cache_held_slots(req, num_cached)
            num_cached = self._clean_len(req, num_cached)
            inserted = self.tree.insert(req.token_ids[:num_cached], req.slots[:num_cached])
            if self.host_tier is not None:
                self.host_tier.free_rows(inserted.revived_host_rows)
            # (a cut inside the prefix leaves its slots to the quarantined nodes that own them)
            self.pool.free(torch.cat([inserted.duplicate_slots, req.slots[max(num_cached, own_start):]]))
        else:
            self.pool.free(req.slots[own_start:])
        if self.tree is not None and req.prefix_node is not None:
            self._unlock(req.prefix_node)
        self._window_users.pop(req.request_id, None)
        self.pool.free_row(req.row)
        req.reset_cache_state()

    def _cache_held_slots(self, req: Request, num_cached: int) -> int:
        """Zoo (``Bug.REJECTED_DRAFT_KV_CACHED``): cache up to the slots ``req`` holds, not the K/V
        it committed; the extra positions hold what rejected drafts wrote."""
        held = min(req.num_tokens, req.capacity) // self.page_size * self.page_size
        if held > num_cached:
            self.zoo.record(Bug.REJECTED_DRAFT_KV_CACHED, f"request={req.request_id} positions {num_cached}.."
                            f"{held - 1} cached with the K/V of rejected drafts", req.slots[num_cached:held],
                            request_id=req.request_id, positions=range(num_cached, held))
        return max(held, num_cached)

    def _clean_len(self, req: Request, num_cached: int) -> int:
        """The longest of ``req``'s first ``num_cached`` positions that may enter the prefix cache:
        up to its first quarantined page or its first prefix node quarantined while it read it."""
        ps, bad, quarantined = self.page_size, num_cached, self.pool.quarantined_pages
        if quarantined:  # (nothing to look for in a healthy engine)
            hit = torch.isin(req.slots[:num_cached:ps] // ps, torch.tensor(sorted(quarantined))).nonzero()
            bad = int(hit[0]) * ps if hit.numel() else num_cached
        if self.tree.detached and req.prefix_node is not None:
            bad = min([bad, *(n.start for n in req.prefix_node.path() if n.is_detached)])
        return bad

    def quarantine(self, bad_slots: torch.Tensor, retire: bool = True) -> int:
        """Take the pages of ``bad_slots`` (int64, CPU) out of the prefix cache and the host tier:
        every node holding one is cut at that page and the rest leaves with its subtree (host rows
        freed; device slots freed, or, where a running request still reads them, when it ends;
        the damaged pages are retired, the others return). Pages a request owns stay its own and
        are never cached (``release``). ``retire``: see ``KVPool.quarantine``. Returns the number
        of pages newly quarantined."""
        fresh = {s for s in bad_slots.tolist() if not self.pool.is_quarantined(s)}  # (re-detections: out already)
        if not fresh:
            return 0
        num_pages = self.pool.quarantine(torch.tensor(sorted(fresh), dtype=torch.int64), retire)
        if self.tree is None:
            return num_pages
        slots, host_rows = self.tree.quarantine(fresh)
        if slots.numel():
            self.pool.free(slots)
        if self.host_tier is not None:
            self.host_tier.free_rows(host_rows)
        self.stats.num_dropped_host_slots += host_rows.numel()
        return num_pages

    def check_integrity(self, requests: Sequence[Request]) -> None:
        """Assert conservation of slots, rows and host rows, tree invariants and each active
        request's page table against its own slot record."""
        active = [r for r in requests if r.is_active]
        owned = [r.slots[r.num_prefix_cached :] for r in active]
        for r in active:
            where = f"request {r.request_id}"
            assert r.num_prefix_cached <= r.num_cached <= r.capacity <= r.num_tokens + self.page_size, (
                f"{where}: prefix {r.num_prefix_cached} <= cached {r.num_cached} <= capacity {r.capacity}"
            )
            assert r.capacity % self.page_size == 0, f"{where}: capacity {r.capacity} is not whole pages"
            table = self.pool.req_to_token[r.row, : r.capacity].to("cpu", torch.int64)
            assert torch.equal(table, r.slots), f"{where}: req_to_token row {r.row} != its slot record"
            if self.tree is not None:
                path = r.prefix_node.path()
                prefix = torch.cat([n.slots for n in path]) if path else r.slots[:0]
                assert r.prefix_node.end == r.num_prefix_cached and torch.equal(
                    prefix, r.slots[: r.num_prefix_cached]
                ), f"{where}: prefix slots != its locked prefix-cache path"
        if self.tree is not None:
            self.tree.check_integrity([r.prefix_node for r in active])
            owned += [n.slots for n in self.tree.nodes() if not n.is_on_host]
            owned += [n.slots for n in self.tree.detached]
        self.pool.check_integrity(owned, [r.row for r in active])
        if self.host_tier is not None:
            self.host_tier.check_integrity()
