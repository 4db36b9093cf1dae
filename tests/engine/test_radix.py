from __future__ import annotations

import pytest
import torch

from kvcanary.engine.radix import RadixCache


def slots_for(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_match_insert_and_split():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3, 4], slots_for(10, 4))
    node, n = tree.match([1, 2, 9])
    assert n == 2 and node.slots.tolist() == [10, 11] and node.end == 2  # the node was split
    result = tree.insert([1, 2, 7, 8], slots_for(20, 4))
    assert result.duplicate_slots.tolist() == [20, 21]  # the first two tokens were cached already
    assert result.node.slots.tolist() == [22, 23] and result.node.start == 2
    assert tree.match([1, 2, 3, 4, 5])[1] == 4 and tree.match([1, 2, 7, 8])[1] == 4
    assert tree.match([5, 1, 2])[1] == 0
    tree.check_integrity()


def test_own_slots_are_not_duplicates():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], slots_for(10, 3))
    result = tree.insert([1, 2, 3, 4, 5], torch.tensor([10, 11, 12, 30, 31]))
    assert result.duplicate_slots.numel() == 0 and result.node.slots.tolist() == [30, 31]


def test_page_aligned_matches():
    tree = RadixCache(page_size=4)
    tree.insert(list(range(8)), slots_for(4, 8))
    assert tree.match(list(range(7)))[1] == 4  # the partial second page does not match
    assert tree.match([0, 1, 2, 3, 4, 5, 6, 99])[1] == 4
    node, n = tree.match([0, 1, 2, 9])
    assert n == 0 and node is tree.root  # a page matches whole or not at all
    with pytest.raises(AssertionError, match="whole pages"):
        tree.insert([1, 2, 3], slots_for(40, 3))
    tree.check_integrity()


def test_locked_nodes_are_never_evicted():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], slots_for(10, 3))
    tree.insert([1, 2, 4], slots_for(20, 3))
    node, _ = tree.match([1, 2, 3, 9])
    tree.lock(node)
    tree.check_integrity([node])
    evicted = tree.evict(100)
    assert evicted.slots.tolist() == [22]  # only the unlocked branch; the locked path and its parent stay
    assert tree.match([1, 2, 3])[1] == 3
    tree.unlock(node)
    tree.check_integrity()
    assert sorted(tree.evict(100).slots.tolist()) == [10, 11, 12]
    assert list(tree.nodes()) == []


def test_lru_order_and_parents_after_children():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2], slots_for(10, 2))
    tree.insert([1, 3], slots_for(20, 2))  # splits [1] off as the shared parent
    tree.insert([5, 6], slots_for(30, 2))
    tree.match([1, 2])  # [1, 2] becomes the most recently used
    assert tree.evict(1).slots.tolist() == [21]  # least recently used leaf: [1, 3]
    assert tree.evict(2).slots.tolist() == [30, 31]
    assert tree.evict(1).slots.tolist() == [11]  # then the leaf [1, 2] ...
    assert tree.evict(1).slots.tolist() == [10]  # ... and only then its parent [1]


def test_lock_counts_are_checked():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], slots_for(10, 3))
    node, _ = tree.match([1, 2, 3])
    tree.lock(node)
    with pytest.raises(AssertionError, match="lock_count"):
        tree.check_integrity()
    tree.check_integrity([node])
    tree.unlock(node)
    with pytest.raises(AssertionError, match="unlock of unlocked"):
        tree.unlock(node)


def test_offload_keeps_node_on_host_and_insert_revives_it():
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4], slots_for(10, 4))
    tree.match([1, 2])  # split: [1, 2] -> [3, 4]
    offloaded = []

    def offload(node):
        offloaded.append(node.slots.clone())
        return torch.arange(100, 100 + len(node.key))

    evicted = tree.evict(4, offload)
    assert evicted.num_offloaded == 4 and sorted(evicted.slots.tolist()) == [10, 11, 12, 13]
    assert [s.tolist() for s in offloaded] == [[12, 13], [10, 11]]  # the child first, then its parent
    node, n = tree.match([1, 2, 3, 4])
    assert n == 4 and all(x.is_on_host for x in node.path())
    tree.check_integrity()
    result = tree.insert([1, 2, 3, 4, 5, 6], slots_for(40, 6))
    assert sorted(result.revived_host_rows.tolist()) == [100, 100, 101, 101]  # each node's rows
    assert result.duplicate_slots.numel() == 0
    assert [x.is_on_host for x in result.node.path()] == [False, False, False]
    tree.check_integrity()


def test_evict_without_host_room_drops_the_host_subtree():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], slots_for(10, 3))
    tree.match([1])
    evicted = tree.evict(3, lambda node: torch.arange(len(node.key)) if len(node.key) == 2 else None)
    assert sorted(evicted.slots.tolist()) == [10, 11, 12] and evicted.host_rows.tolist() == [0, 1]
    assert list(tree.nodes()) == []


def test_quarantine_cuts_at_the_damaged_page_and_detaches_what_a_reader_locks():
    tree = RadixCache(page_size=2)
    tree.insert(list(range(8)), slots_for(20, 8))  # one node: tokens 0..7 in slots 20..27
    tree.insert([0, 1, 2, 3, 9, 9], torch.tensor([20, 21, 22, 23, 40, 41]))  # a sibling after position 4
    reader, n = tree.match([0, 1, 2, 3, 4, 5])
    assert n == 6
    tree.lock(reader)
    # slot 23 (position 3, page [2, 4)) is damaged: positions 0..1 stay cached
    slots, rows = tree.quarantine({23})
    assert tree.match([0, 1, 2, 3, 4, 5, 6, 7])[1] == 2 and tree.match([0, 1, 2, 3, 9, 9])[1] == 2
    # released now: the unlocked rest (positions 6..7) and the sibling; the locked path stays detached
    assert sorted(slots.tolist()) == [26, 27, 40, 41] and rows.numel() == 0
    assert sorted((n.start, n.slots.tolist()) for n in tree.detached) == [(2, [22, 23]), (4, [24, 25])]
    tree.check_integrity([reader])
    assert sorted(tree.unlock(reader).tolist()) == [22, 23, 24, 25]  # its last lock: released
    assert tree.detached == []
    tree.check_integrity()


def test_quarantine_finds_host_nodes_by_the_slots_they_were_offloaded_from():
    tree = RadixCache(page_size=2)
    tree.insert(list(range(6)), slots_for(10, 6))
    evicted = tree.evict(6, offload=lambda node: torch.arange(100, 100 + len(node.key)))
    assert evicted.slots.tolist() == list(range(10, 16)) and evicted.num_offloaded == 6
    slots, rows = tree.quarantine({14})  # position 4: the host node is cut there
    assert slots.numel() == 0 and rows.tolist() == [104, 105]
    (node,) = tree.root.children.values()
    assert node.is_on_host and node.host_rows.tolist() == [100, 101, 102, 103]
    assert node.offloaded_from.tolist() == [10, 11, 12, 13]
    tree.check_integrity()
