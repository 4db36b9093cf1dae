"""Faults injected into transformers' real paged cache through the adapter's step hooks.

Each is called at the start of every step (before scheduling) and acts once; ``slots`` names the
slots it damaged. They touch transformers' state the way the bug they stand for would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._setup import SYSTEM_LEN


def _flip(view, slot: int, byte: int = 3) -> None:
    """Flip one bit inside the first 16 bytes of ``slot``'s row (what partial fingerprints cover)."""
    view[slot].view(-1).view(torch.uint8)[byte] ^= 0x10


@dataclass
class Fault:
    warmup_steps: int = 8
    step: int | None = None
    slots: list[int] = field(default_factory=list)  # damaged slots
    request_id: str | None = None  # the request whose view of the cache is damaged
    followed: set[int] = field(default_factory=set)  # slots that request's pages occupied later (offload moves them)

    def __call__(self, att, step: int) -> None:
        if self.step is None and step >= self.warmup_steps and self.act(att):
            self.step = step
        elif self.step is not None and self.request_id is not None:
            for block in att.layout.block_table(self.request_id) or ():
                self.followed.update(att.layout.block_slots(block))

    def act(self, att) -> bool:
        raise NotImplementedError

    @staticmethod
    def decoding(att, min_len: int):
        for state in att.processor.scheduler.active_requests.values():
            if state.status.name == "DECODING" and state.position_offset >= min_len and not state.is_cpu_offloaded:
                table = att.layout.block_table(state.request_id)
                if table and len(table) * att.layout.page_size >= state.position_offset:
                    return state, table
        return None, None


class BlockTableSwap(Fault):
    """Two entries of a running request's block table trade places: attention reads pages 0 and 1 swapped."""

    def act(self, att):
        page = att.layout.page_size
        state, table = self.decoding(att, 2 * page + 1)
        if state is None:
            return False
        table[0], table[1] = table[1], table[0]
        self.request_id = state.request_id
        self.slots = att.layout.block_slots(table[0]) + att.layout.block_slots(table[1])
        return True


class UsedBlockFlip(Fault):
    """A bit flips in the K/V of the last slot a running request wrote (a page only it owns)."""

    def act(self, att):
        state, table = self.decoding(att, 2)
        if state is None:
            return False
        slot = att.layout.slots_of(table, state.position_offset)[-1]
        _flip(att.layout.kv_views(0)[0], slot)
        self.slots, self.request_id = [slot], state.request_id
        return True


class CachedBlockFlip(Fault):
    """A bit flips in an idle prefix-cache page no later prompt will match (past the system prompt)."""

    def act(self, att):
        for block in att.layout.cached_blocks():
            first = att.layout.block_slots(block)[0]
            info = att._blocks.get(first)
            if info is not None and info.start_position >= SYSTEM_LEN:
                _flip(att.layout.kv_views(0)[0], first)
                self.slots = [first]
                return True
        return False


class OffloadCopyFlip(Fault):
    """A bit flips in the CPU swap-pool copy of an offloaded request's first page (layer 0's K)."""

    def act(self, att):
        om = att.processor.offloading_manager
        if not om._request_id_to_cpu_blocks:
            return False
        self.request_id, cpu_blocks = next(iter(om._request_id_to_cpu_blocks.items()))
        if isinstance(cpu_blocks, dict):  # 5.24: one flat pinned tensor, viewed per allocator as whole blocks
            name, cpu_ids = next(iter(cpu_blocks.items()))
            alloc = att.processor.cache.cache_allocators[name]
            probe = att.layout.block_slots(1)[0]  # byte offset of a page's first K row inside its block
            offset = att.layout.kv_views(0)[0][probe].data_ptr() - alloc._copy_view[1].data_ptr()
            om._cpu_views[name][cpu_ids[0], offset + 3] ^= 0x10
        else:  # 5.17: one [blocks, block_size, heads, dim] tensor per layer and half
            om._cpu_key_cache[0][cpu_blocks[0], 0].view(-1).view(torch.uint8)[3] ^= 0x10
        return True
