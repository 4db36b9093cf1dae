"""Where transformers' paged cache keeps each token's K/V, for the two internal layouts we support.

A *slot* is the physical token index transformers itself writes (``write_index``) and reads
(``read_index``); the canary buffer is indexed by it. The two layouts:

| transformers | cache tensors                               | slot of (block b, offset o)  | idle cached blocks      |
|--------------|---------------------------------------------|------------------------------|-------------------------|
| 5.17         | ``key_cache[l]`` / ``value_cache[l]``,      | ``b * block_size + o``       | ``_init_block_ids``     |
|              | ``[(num_blocks + 2) * block_size, h, d]``   | (block 0 is held back: slot  | of the block manager    |
|              |                                             | 0 is the canary's padding)   |                         |
| 5.24         | one flat tensor; per-layer shifted views    | ``b * block_physical_stride  | ``ledger.cached_blocks``|
|              | ``_kv_token_views[l] = (k, v)``             | + o`` (slot 0: read trash)   | of the allocator        |

The layout is recognised by the cache's attributes, not by version number. Only models whose
layers are all full attention are supported (one allocator / group).
"""

from __future__ import annotations

import torch

from kvcanary.errors import ConfigError


class CacheLayout:
    """Slots, KV buffers and prefix-cache state of one ``PagedAttentionCache``."""

    page_size: int
    num_slots: int

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major K and V views ``[rows, heads, dim]`` of ``layer``; row = slot."""
        raise NotImplementedError

    def block_slots(self, block: int) -> list[int]:
        return [block * self.block_stride + o for o in range(self.page_size)]

    def slots_of(self, blocks: list[int], length: int) -> list[int]:
        """Slots of positions [0, length) of a request whose block list is ``blocks``."""
        return [blocks[p // self.page_size] * self.block_stride + p % self.page_size for p in range(length)]

    def block_of_slot(self, slot: int) -> int:
        return slot // self.block_stride

    def cached_blocks(self) -> list[int]:
        """Blocks held by the prefix cache that no running request references."""
        raise NotImplementedError

    def is_hashed(self, block: int) -> bool:
        """True while the prefix cache holds ``block`` as complete (its K/V may not change)."""
        raise NotImplementedError

    def block_table(self, request_id: str) -> list[int] | None:
        """The live block list of a request (mutable: fault injection writes it)."""
        raise NotImplementedError

    def before_step(self) -> None:
        """Called before each step is scheduled."""


class SectorLayout(CacheLayout):
    """transformers 5.24: cache allocators over sectors of one flat cache tensor."""

    def __init__(self, cache):
        allocators = list(cache.cache_allocators.values())
        if len(allocators) != 1 or allocators[0].layer_type != "full_attention":
            raise ConfigError(f"the transformers adapter supports full-attention models only; this model's cache has "
                              f"allocators {list(cache.cache_allocators)}")
        self.allocator = a = allocators[0]
        self.page_size = a.tokens_per_page
        self.block_stride = a.block_physical_stride
        self.num_slots = min(v.shape[0] for kv in a._kv_token_views.values() for v in kv)

    def kv_views(self, layer):
        return self.allocator._kv_token_views[layer]

    def cached_blocks(self):
        return list(self.allocator.ledger.cached_blocks)

    def is_hashed(self, block):
        return block in self.allocator.ledger.block_to_hash

    def block_table(self, request_id):
        return self.allocator.block_table.get(request_id)


class GroupLayout(CacheLayout):
    """transformers 5.17: one K and one V tensor per layer, a block manager per cache."""

    def __init__(self, cache):
        groups = cache.group_cache_managers
        if len(groups) != 1 or type(groups[0]).__name__ != "FullAttentionCacheAllocator":
            raise ConfigError(f"the transformers adapter supports full-attention models only; this model's cache has "
                              f"{len(groups)} layer groups of types {[type(g).__name__ for g in groups]}")
        self.cache, self.group = cache, groups[0]
        self.page_size = self.block_stride = cache.block_size
        self.num_slots = cache.key_cache[0].shape[0]
        self.manager = cache._block_manager
        self.holds_block_zero = False
        self.before_step()

    def before_step(self):
        """Slot 0 is the canary's padding slot: keep block 0 out of circulation (if it was in use when
        the canary attached, as soon as it is freed)."""
        if self.holds_block_zero:
            return
        free = self.manager._uninit_block_ids
        if 0 in free:
            free.remove(0)
            self.holds_block_zero = True
        elif 0 not in self.manager._id_to_block and 0 not in self.manager._init_block_ids:
            self.holds_block_zero = not any(0 in t for t in self.group.block_table.values())

    def kv_views(self, layer):
        j = self.cache.layer_index_to_group_indices[layer][1]
        return self.cache.key_cache[j], self.cache.value_cache[j]

    def cached_blocks(self):
        return list(self.manager._init_block_ids)

    def is_hashed(self, block):
        b = self.manager._id_to_block.get(block)
        return b is not None and b.hash is not None and self.manager._hash_to_id.get(b.hash) == block

    def block_table(self, request_id):
        return self.group.block_table.get(request_id)


def layout_for(cache) -> CacheLayout:
    if hasattr(cache, "cache_allocators"):
        return SectorLayout(cache)
    if hasattr(cache, "group_cache_managers"):
        return GroupLayout(cache)
    raise ConfigError(f"unrecognised PagedAttentionCache layout ({type(cache).__module__}); "
                      "this transformers version is not supported by the adapter")
