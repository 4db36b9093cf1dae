from __future__ import annotations

import pytest
import torch

from kvcanary.engine import EngineHooks, ModelConfig
from kvcanary.engine.pool import KVPool

from ._helpers import RecordingHooks, engine_config


def make_pool(
    page_size: int = 1, num_slots: int = 64, host: int = 0, hooks: EngineHooks | None = None
) -> KVPool:
    config = engine_config(
        num_slots=num_slots, page_size=page_size, max_rows=5, max_running=4, host_tier_slots=host
    )
    return KVPool(ModelConfig(), config, hooks or EngineHooks())


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_hands_out_whole_pages_never_page_zero(page_size):
    pool = make_pool(page_size)
    usable = 64 - page_size
    assert pool.num_free_slots == usable
    a = pool.alloc(2 * page_size)
    b = pool.alloc(usable - 2 * page_size)
    assert pool.alloc(page_size) is None and pool.num_free_slots == 0
    slots = torch.cat([a, b])
    assert sorted(slots.tolist()) == list(range(page_size, 64))
    assert torch.equal(a.view(-1, page_size) % page_size, torch.arange(page_size).expand(2, page_size))
    pool.check_integrity([a, b], [])
    pool.free(a)
    pool.check_integrity([b], [])
    assert pool.num_free_slots == 2 * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_integrity_catches_leaks_double_ownership_and_partial_pages(page_size):
    pool = make_pool(page_size)
    a, b = pool.alloc(2 * page_size), pool.alloc(page_size)
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity([a], [])
    with pytest.raises(AssertionError, match="owned twice"):
        pool.check_integrity([a, b, b], [])
    with pytest.raises(AssertionError, match="two states"):
        pool.check_integrity(
            [a, b, torch.tensor([pool._free_pages[0] * page_size + i for i in range(page_size)])], []
        )
    if page_size > 1:
        with pytest.raises(AssertionError, match="partly"):
            pool.check_integrity([a, b[:1]], [])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a)
        pool.free(a)


def test_rows_are_reused_and_zeroed():
    pool = make_pool()
    rows = [pool.alloc_row() for _ in range(4)]
    assert rows == [1, 2, 3, 4] and pool.alloc_row() is None
    pool.req_to_token[2, :3] = torch.tensor([5, 6, 7], dtype=torch.int32)
    pool.free_row(2)
    assert int(pool.req_to_token[2].abs().sum()) == 0
    with pytest.raises(AssertionError, match="row conservation"):
        pool.check_integrity([], [1, 3])
    pool.check_integrity([], [1, 3, 4])
    with pytest.raises(AssertionError, match="double free of row"):
        pool.free_row(2)


@pytest.mark.parametrize("page_size", [1, 4])
def test_quarantined_pages_never_return(page_size):
    pool = make_pool(page_size, num_slots=8 * page_size)
    owned = pool.alloc(2 * page_size)
    free_slot = pool._free_pages[0] * page_size + page_size - 1
    assert pool.quarantine(torch.tensor([int(owned[0]), free_slot, 0])) == 2  # page 0 is ignored
    pool.check_integrity([owned], [])
    pool.free(owned)  # the quarantined page stays out
    assert pool.num_quarantined_slots == 2 * page_size
    pool.check_integrity([], [])
    everything = pool.alloc(pool.num_free_slots)
    assert int(owned[0]) not in everything.tolist() and free_slot not in everything.tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_quarantine_without_retire_lasts_until_the_owner_frees(page_size):
    hooks = RecordingHooks()
    pool = make_pool(page_size, num_slots=8 * page_size, hooks=hooks)
    owned = pool.alloc(2 * page_size)
    free_slot = pool._free_pages[0] * page_size
    # only the owned page: a free one needs nothing, page 0 is skipped
    assert pool.quarantine(torch.tensor([int(owned[-1]), free_slot, 0]), retire=False) == 1
    assert pool.quarantine(owned[-1:], retire=False) == 0
    assert pool.num_quarantined_slots == page_size and pool.is_quarantined(int(owned[-1]))
    assert not pool.is_quarantined(int(owned[0])) and not pool.is_quarantined(free_slot)
    pool.check_integrity([owned], [])
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity([owned[:page_size]], [])
    pool.free(owned)  # back to the free list, as a plain free
    assert hooks.names() == ["on_free"] and hooks.events[0][1][0].tolist() == owned.tolist()
    assert pool.num_quarantined_slots == 0 and not pool.is_quarantined(int(owned[-1]))
    pool.check_integrity([], [])
    assert set(owned.tolist()) <= set(pool.alloc(pool.num_free_slots).tolist())


def test_free_reports_returned_slots_to_hooks():
    hooks = RecordingHooks()
    pool = make_pool(page_size=4, hooks=hooks)
    slots = pool.alloc(8)
    pool.quarantine(slots[:1])
    pool.free(slots)
    assert hooks.names() == ["on_free", "on_retire"]  # the quarantined page stays out: its incidents close
    assert hooks.events[0][1][0].tolist() == slots[4:].tolist()
    assert hooks.events[1][1][0].tolist() == slots[:4].tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_round_trip_is_byte_equal(page_size):
    hooks = RecordingHooks()
    pool = make_pool(page_size, host=16, hooks=hooks)
    gen = torch.Generator().manual_seed(3)
    src = pool.alloc(2 * page_size)
    for buf in pool.k_buffers + pool.v_buffers:
        buf[src] = torch.randn(len(src), *buf.shape[1:], generator=gen, dtype=buf.dtype)
    # rows that move with the K/V in the same copy (a canary's records): random bytes, 5 a slot
    side = (torch.randint(0, 256, (pool.num_slots, 5), dtype=torch.uint8, generator=gen),
            torch.zeros(16, 5, dtype=torch.uint8))
    pool.move_with_kv([side])
    before = [buf[src].clone() for buf in pool.k_buffers + pool.v_buffers]
    side_before = side[0][src].clone()
    rows = torch.randperm(16, generator=gen)[: len(src)]
    pool.copy_to_host(src, rows)
    assert torch.equal(side[1][rows], side_before)
    dst = pool.alloc(2 * page_size)
    pool.copy_from_host(rows, dst)
    for buf, old in zip(pool.k_buffers + pool.v_buffers, before, strict=True):
        assert torch.equal(buf[dst].view(torch.uint8), old.view(torch.uint8))
        assert bool(old.abs().sum() > 0)
    assert torch.equal(side[0][dst], side_before) and bool(side_before.sum() > 0)
    assert hooks.names() == ["before_move", "on_offload", "before_move", "on_load"]
    assert hooks.events[1][1][0].tolist() == src.tolist() and hooks.events[1][1][1].tolist() == rows.tolist()
    assert hooks.events[3][1][0].tolist() == rows.tolist() and hooks.events[3][1][1].tolist() == dst.tolist()


def test_rows_that_move_with_the_kv_must_fit_the_pool_and_the_host_tier():
    pool = make_pool(page_size=4, host=16)
    n = pool.num_slots
    bad = [((torch.zeros(n, 4, dtype=torch.uint8), torch.zeros(15, 4, dtype=torch.uint8)),
            r"pairs\[0\]: want uint8\[host_tier_slots = 16, w\] on cpu, got torch.uint8\[15, 4\] on cpu"),
           ((torch.zeros(n, 4, dtype=torch.int32), torch.zeros(16, 4, dtype=torch.uint8)),
            rf"pairs\[0\]: want uint8\[num_slots = {n}, w\] on cpu, got torch.int32\[{n}, 4\] on cpu"),
           ((torch.zeros(n, 4, dtype=torch.uint8), torch.zeros(16, 8, dtype=torch.uint8)),
            r"pairs\[0\]: device rows of 4 bytes != host rows of 8")]
    for pair, message in bad:
        with pytest.raises(ValueError, match=message):
            pool.move_with_kv([pair])
    assert len(pool._moved) == 2 * len(pool.full_layers)  # nothing was added
