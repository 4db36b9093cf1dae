"""Radix prefix cache: a tree of token runs whose K/V stays in the pool after a request ends.

Keys are page-aligned: every node holds a whole number of pages of tokens and matches are
made page by page, so a cached prefix always ends on a page boundary. A node is either on the
device (``slots``) or, after eviction to the host tier, on the host (``host_rows``); on every
root-to-leaf path device nodes come first, so a host node has only host children.

Locks: a running request locks the node its matched prefix ends at; ``lock_count`` of a node
counts the locks at or below it. Locked nodes are never evicted. Eviction takes device nodes
with no device children in least-recently-used order. The tree knows no pool: it returns
slots and host rows, and the caller frees them.

Quarantine (``quarantine``): a node holding a damaged slot is cut at the damaged slot's page and
the rest leaves the index with its subtree, so no later match reaches it. Unlocked nodes of it
are released at once; a node a running request still reads stays *detached* (out of the index,
its slots still its own) until its last lock goes, and ``unlock`` returns its slots then. A host
node remembers the device slots it was offloaded from (``offloaded_from``), so damage reported
after the offload reaches it too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvcanary.engine.zoo import Bug, Zoo

_EMPTY = torch.zeros(0, dtype=torch.int64)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else _EMPTY.clone()


class RadixNode:
    """A run of tokens at positions ``[start, start + len(key))`` and where their K/V lives.

    ``slots`` / ``host_rows``: int64[len(key)] on the CPU; exactly one is set (the root: slots).
    """

    def __init__(
        self, key: tuple[int, ...], slots: torch.Tensor | None, parent: RadixNode | None, start: int
    ):
        self.key, self.slots, self.parent, self.start = key, slots, parent, start
        self.host_rows: torch.Tensor | None = None
        self.offloaded_from: torch.Tensor | None = None  # on the host: the device slots it came from
        self.is_detached = False  # quarantined while locked: out of the index until its last unlock
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_count = 0
        self.last_access = 0
        self.sweep_run: tuple | None = None  # ``Engine.prefix_cache_slots``' run of this node, and what it was made of

    @property
    def is_on_host(self) -> bool:
        return self.slots is None

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def path(self) -> list[RadixNode]:
        """Nodes from the root's child down to this node (empty for the root)."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def __repr__(self) -> str:
        where = "host" if self.is_on_host else "device"
        return f"RadixNode(start={self.start}, len={len(self.key)}, {where}, locks={self.lock_count})"


@dataclass(frozen=True)
class InsertResult:
    node: RadixNode  # deepest node holding the inserted tokens
    duplicate_slots: torch.Tensor  # caller's slots for tokens the tree already held: caller frees them
    revived_host_rows: torch.Tensor  # host rows of host nodes now backed by the caller's slots: free them


@dataclass(frozen=True)
class Evicted:
    slots: torch.Tensor  # device slots released: caller frees them
    host_rows: torch.Tensor  # host rows of dropped host descendants: caller frees them
    num_offloaded: int  # of ``slots``, how many were kept on the host first


class RadixCache:
    def __init__(self, page_size: int, zoo: Zoo | None = None):
        self.page_size = page_size
        self.zoo = zoo if zoo is not None else Zoo()
        self.root = RadixNode((), _EMPTY.clone(), None, 0)
        self.root.lock_count = 1  # never evicted
        self._clock = itertools.count(1)
        self._stale: set[RadixNode] = set()  # zoo (Bug.STALE_RADIX_NODE): freed but still in the tree
        self.detached: list[RadixNode] = []  # quarantined nodes running requests still read

    def _common_len(self, key: tuple[int, ...], tokens: Sequence[int], i: int) -> int:
        limit, n = min(len(key), len(tokens) - i), 0
        while n < limit and key[n] == tokens[i + n]:
            n += 1
        return n - n % self.page_size

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node`` after ``n`` tokens; returns the new upper node (``node`` keeps the rest)."""
        ps = self.page_size
        upper = RadixNode(node.key[:n], None, node.parent, node.start)
        if node.is_on_host:
            upper.host_rows, node.host_rows = node.host_rows[:n].clone(), node.host_rows[n:].clone()
            if node.offloaded_from is not None:
                upper.offloaded_from, node.offloaded_from = node.offloaded_from[:n], node.offloaded_from[n:]
        else:
            upper.slots, node.slots = node.slots[:n].clone(), node.slots[n:].clone()
        upper.lock_count, upper.last_access = node.lock_count, node.last_access
        if node in self._stale:  # zoo: both halves hold freed slots
            self._stale.add(upper)
        node.parent.children[node.key[:ps]] = upper
        node.key, node.start, node.parent = node.key[n:], node.start + n, upper
        upper.children[node.key[:ps]] = node
        return upper

    def match(self, tokens: Sequence[int]) -> tuple[RadixNode, int]:
        """Longest cached page-aligned prefix of ``tokens`` (device or host nodes).

        Returns the node it ends at and its length. Splits a node when the match ends inside it;
        marks the matched path as used now (LRU).
        """
        ps, node, i, now = self.page_size, self.root, 0, next(self._clock)
        while i + ps <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                if Bug.PARTIAL_PAGE_HIT in self.zoo:
                    node, i = self._partial_page_hit(node, tokens, i, now)
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return node, i

    def _partial_page_hit(self, node: RadixNode, tokens: Sequence[int], i: int, now: int) -> tuple[RadixNode, int]:
        """Zoo (``Bug.PARTIAL_PAGE_HIT``): a device child whose first token matches is taken for the
        next page without checking the rest of the page."""
        child = next((c for c in node.children.values() if c.key[0] == tokens[i] and not c.is_on_host), None)
        if child is None:
            return node, i
        if len(child.key) > self.page_size:
            child = self._split(child, self.page_size)
        child.last_access = now
        wrong = [p for p in range(self.page_size) if child.key[p] != tokens[i + p]]
        self.zoo.record(Bug.PARTIAL_PAGE_HIT, f"page at {i} taken for tokens that differ at offsets {wrong}",
                        child.slots)
        return child, i + self.page_size

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> InsertResult:
        """Cache ``tokens`` (a page multiple) whose K/V is in ``slots`` (int64, CPU).

        Slots for tokens already cached on the device are not adopted (see ``duplicate_slots``);
        host nodes on the path are revived with the caller's slots.
        """
        ps, node, i, now = self.page_size, self.root, 0, next(self._clock)
        assert len(tokens) % ps == 0 and len(tokens) == slots.numel(), "insert needs whole pages"
        duplicates, revived = [], []
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                child = RadixNode(tuple(tokens[i:]), slots[i:].clone(), node, i)
                node.children[child.key[:ps]] = child
                child.last_access, node = now, child
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            segment = slots[i : i + n]
            if child.is_on_host:
                revived.append(child.host_rows)
                child.slots, child.host_rows = segment.clone(), None
            else:
                duplicates.append(segment[segment != child.slots])
            child.last_access, node, i = now, child, i + n
        return InsertResult(node, _cat(duplicates), _cat(revived))

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> torch.Tensor:
        """Drop one lock of ``node`` (and its path). Returns the slots of detached nodes whose last
        lock it was (int64, CPU; usually empty, then shared: read only): the caller frees them."""
        released = []
        while node is not self.root:
            assert node.lock_count > 0, f"unlock of unlocked {node}"
            node.lock_count -= 1
            if node.is_detached and node.lock_count == 0:
                self.detached.remove(node)
                if node not in self._stale:  # (zoo: a stale node's slots were freed already)
                    released.append(node.slots)
                self._stale.discard(node)
            node = node.parent
        return _cat(released) if released else _EMPTY

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def remove(self, node: RadixNode) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop ``node`` and its subtree (all unlocked). Returns their device slots and host rows."""
        del node.parent.children[node.key[: self.page_size]]
        subtree, stack = [], [node]
        while stack:
            n = stack.pop()
            assert n.lock_count == 0, f"remove of locked {n}"
            subtree.append(n)
            stack.extend(n.children.values())
        slots = _cat([n.slots for n in subtree if not n.is_on_host])
        return slots, _cat([n.host_rows for n in subtree if n.is_on_host])

    def quarantine(self, bad_slots: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Take every page holding one of ``bad_slots`` out of the index, with everything cached
        after it: a node is cut at its first bad page (the pages before it stay cached), the rest
        and its subtree leave. Device nodes match by their slots, host nodes by the slots they
        were offloaded from. Returns (device slots, host rows) released now (the caller frees
        them); locked nodes stay detached until ``unlock`` releases them."""
        ps, hits = self.page_size, []
        for node in self.nodes():
            held = node.slots if not node.is_on_host else node.offloaded_from
            if held is None:
                continue
            bad = [i for i, s in enumerate(held.tolist()) if s in bad_slots]
            if bad:
                hits.append((node, bad[0] // ps * ps))
        hit_ids = {id(n) for n, _ in hits}
        slots, rows = [], []
        for node, cut in hits:
            if any(id(a) in hit_ids for a in node.path()[:-1]):
                continue  # leaves with its ancestor's subtree
            if cut:
                self._split(node, cut)
            s, r = self._detach(node)
            slots.append(s)
            rows.append(r)
        return _cat(slots), _cat(rows)

    def _detach(self, node: RadixNode) -> tuple[torch.Tensor, torch.Tensor]:
        """``node`` and its subtree leave the index: unlocked ones are released (their slots and
        host rows returned), locked ones stay detached."""
        del node.parent.children[node.key[: self.page_size]]
        slots, rows, stack = [], [], [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.lock_count:
                assert not n.is_on_host, f"locked host node {n}"
                n.is_detached = True
                self.detached.append(n)
            elif n in self._stale:  # zoo: its slots were freed already
                self._stale.discard(n)
            elif n.is_on_host:
                rows.append(n.host_rows)
            else:
                slots.append(n.slots)
        return _cat(slots), _cat(rows)

    def _is_evictable(self, node: RadixNode) -> bool:
        return (
            node is not self.root
            and not node.is_on_host
            and node.lock_count == 0
            and all(c.is_on_host for c in node.children.values())
            and node not in self._stale
        )

    def evict(
        self, num_slots: int, offload: Callable[[RadixNode], torch.Tensor | None] | None = None
    ) -> Evicted:
        """Release at least ``num_slots`` device slots if possible, least recently used first.

        ``offload(node)`` may copy the node to the host and return its host rows; the node then
        stays in the tree on the host. Otherwise the node and its host subtree are dropped.
        """
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self.nodes() if self._is_evictable(n)]
        heapq.heapify(heap)
        freed, dropped, num_freed, num_offloaded = [], [], 0, 0
        while heap and num_freed < num_slots:
            node = heapq.heappop(heap)[2]
            if not self._is_evictable(node):
                continue
            rows = offload(node) if offload is not None else None
            if rows is not None:
                freed.append(node.slots)
                node.offloaded_from, node.slots, node.host_rows = node.slots, None, rows
                num_offloaded += rows.numel()
            elif Bug.STALE_RADIX_NODE in self.zoo and not node.children:
                # zoo: the slots are freed and the node leaves the eviction list, not its parent
                freed.append(node.slots.clone())
                self._stale.add(node)
                self.zoo.record(Bug.STALE_RADIX_NODE, f"{node} freed but left in the tree", node.slots)
            else:
                slots, host_rows = self.remove(node)
                freed.append(slots)
                dropped.append(host_rows)
            num_freed += freed[-1].numel()
            if self._is_evictable(node.parent):
                heapq.heappush(heap, (node.parent.last_access, next(tie), node.parent))
        return Evicted(_cat(freed), _cat(dropped), num_offloaded)

    def check_integrity(self, locked: Sequence[RadixNode] = ()) -> None:
        """Assert the tree's shape, placement and lock invariants; ``locked`` lists one node per
        lock a request holds."""
        expected: dict[int, int] = {}
        for node in locked:
            for n in node.path():
                expected[id(n)] = expected.get(id(n), 0) + 1
        ps = self.page_size
        for n in self.nodes():
            where = f"{n} (tokens {n.key[:8]}...)"
            assert n.parent.children.get(n.key[:ps]) is n, f"{where} is not its parent's child"
            assert len(n.key) > 0 and len(n.key) % ps == 0, f"{where}: key is not whole pages"
            assert n.start == n.parent.end, f"{where}: start != parent end {n.parent.end}"
            held = n.host_rows if n.is_on_host else n.slots
            assert (n.slots is None) != (n.host_rows is None), (
                f"{where}: must be on exactly one of device/host"
            )
            assert held.numel() == len(n.key), f"{where}: holds {held.numel()} rows for {len(n.key)} tokens"
            assert not n.is_on_host or all(c.is_on_host for c in n.children.values()), (
                f"{where}: host node with a device child"
            )
            assert n.lock_count == expected.get(id(n), 0), (
                f"{where}: lock_count {n.lock_count} != {expected.get(id(n), 0)} locks held by requests"
            )
        for n in self.detached:
            assert n.is_detached and not n.is_on_host and n.lock_count == expected.get(id(n), 0) > 0, (
                f"detached {n}: lock_count {n.lock_count} != {expected.get(id(n), 0)} locks held by requests (> 0)"
            )
