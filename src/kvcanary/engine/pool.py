"""The paged KV pool: K/V buffers, the slot allocator, the page table and host storage.

Slot ``s`` lives on page ``s // page_size``. Page 0 is reserved (padding writes land in slot
0), and so is page-table row 0. Allocation is by whole pages, first-in first-out.

Ownership of every usable page, checked by ``check_integrity``:

| state        | held by                                                   |
|--------------|-----------------------------------------------------------|
| free         | the allocator (handed out again)                          |
| quarantined  | nobody, ever again (``quarantine``: suspected corruption) |
| owned        | exactly one prefix-cache node or one request              |

A page quarantined while owned stays owned until its owner frees it, then stays out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

import torch

from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.hooks import EngineHooks


class KVPoolBase(ABC):
    """What the engine needs from a paged KV pool. Side effects are listed per method."""

    page_size: int
    req_to_token: torch.Tensor  # int32[max_rows, max_ctx], (row, position) -> slot
    k_buffers: list[torch.Tensor]  # per layer [num_slots, num_kv_heads, head_dim]
    v_buffers: list[torch.Tensor]

    @abstractmethod
    def alloc(self, num_slots: int) -> torch.Tensor | None:
        """Take ``num_slots`` (a page multiple) from the free list: int64[num_slots] on the CPU,
        whole pages in order, or None (nothing taken) when too few are free."""

    @abstractmethod
    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages to the free list (quarantined pages stay out), then call
        ``hooks.on_free`` with the returned slots."""

    @abstractmethod
    def alloc_row(self) -> int | None:
        """Take a page-table row (>= 1), or None when all are in use."""

    @abstractmethod
    def free_row(self, row: int) -> None:
        """Return ``row`` and point all its entries at slot 0."""

    @abstractmethod
    def copy_to_host(self, slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy K and V of every layer from ``slots`` to ``host_rows``, then ``hooks.on_offload``."""

    @abstractmethod
    def copy_from_host(self, host_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy K and V of every layer from ``host_rows`` into ``slots``, then ``hooks.on_load``."""

    @abstractmethod
    def check_integrity(self, owned: Sequence[torch.Tensor], used_rows: Sequence[int]) -> None:
        """Assert every usable page is exactly one of free / quarantined / in ``owned`` (slot
        tensors of whole pages; a quarantined page may stay owned until freed), and every
        row >= 1 is free or in ``used_rows``."""


class KVPool(KVPoolBase):
    def __init__(self, model_config: ModelConfig, config: EngineConfig, hooks: EngineHooks):
        self.config, self.hooks = config, hooks
        self.page_size = config.page_size
        self.num_slots = config.num_slots
        self.device = torch.device(config.device)
        shape = (config.num_slots, model_config.num_kv_heads, model_config.head_dim)
        make = lambda: torch.zeros(shape, dtype=model_config.dtype, device=self.device)
        self.k_buffers = [make() for _ in range(model_config.num_layers)]
        self.v_buffers = [make() for _ in range(model_config.num_layers)]
        self.req_to_token = torch.zeros(
            config.max_rows, config.max_ctx, dtype=torch.int32, device=self.device
        )
        host_shape = (model_config.num_layers, config.host_tier_slots, *shape[1:])
        pin = self.device.type == "cuda"
        self.host_k = torch.zeros(host_shape, dtype=model_config.dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_shape, dtype=model_config.dtype, pin_memory=pin)
        self._free_pages = deque(range(1, config.num_pages))
        self._is_free = [False] + [True] * (config.num_pages - 1)
        self._quarantined: set[int] = set()
        self._free_rows = deque(range(1, config.max_rows))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_quarantined_slots(self) -> int:
        return len(self._quarantined) * self.page_size

    def _pages_of(self, slots: torch.Tensor) -> list[int]:
        ps = self.page_size
        assert slots.numel() % ps == 0, f"{slots.numel()} slots are not whole pages of {ps}"
        pages = slots.view(-1, ps)
        assert torch.equal(pages - pages[:, :1], torch.arange(ps).expand_as(pages)) and bool(
            (pages[:, 0] % ps == 0).all()
        ), f"slots {slots.tolist()[:16]} are not whole pages"
        return (pages[:, 0] // ps).tolist()

    def alloc(self, num_slots: int) -> torch.Tensor | None:
        assert num_slots % self.page_size == 0, f"alloc of {num_slots} slots: not a page multiple"
        num_pages = num_slots // self.page_size
        if num_pages > len(self._free_pages):
            return None
        pages = [self._free_pages.popleft() for _ in range(num_pages)]
        for p in pages:
            self._is_free[p] = False
        first = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (first[:, None] + torch.arange(self.page_size)).flatten()

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.to("cpu", torch.int64)
        returned = []
        for p in self._pages_of(slots):
            assert 0 < p < len(self._is_free) and not self._is_free[p], f"double free or bad page {p}"
            if p in self._quarantined:
                continue
            self._is_free[p] = True
            self._free_pages.append(p)
            returned.append(p)
        if returned:
            first = torch.tensor(returned, dtype=torch.int64) * self.page_size
            self.hooks.on_free((first[:, None] + torch.arange(self.page_size)).flatten().to(self.device))

    def quarantine(self, slots: torch.Tensor) -> int:
        """Never hand out the pages of ``slots`` again. Free pages leave the free list now; owned
        ones are kept out when their owner frees them. Returns the number of newly quarantined pages."""
        pages = set((slots.to("cpu", torch.int64) // self.page_size).tolist()) - {0} - self._quarantined
        for p in pages:
            if self._is_free[p]:
                self._free_pages.remove(p)
                self._is_free[p] = False
        self._quarantined |= pages
        return len(pages)

    def alloc_row(self) -> int | None:
        return self._free_rows.popleft() if self._free_rows else None

    def free_row(self, row: int) -> None:
        assert 0 < row < self.config.max_rows and row not in self._free_rows, f"double free of row {row}"
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    def copy_to_host(self, slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        slots, host_rows = slots.to(self.device, torch.int64), host_rows.to("cpu", torch.int64)
        self.host_k[:, host_rows] = torch.stack([k[slots] for k in self.k_buffers]).cpu()
        self.host_v[:, host_rows] = torch.stack([v[slots] for v in self.v_buffers]).cpu()
        self.hooks.on_offload(slots, host_rows)

    def copy_from_host(self, host_rows: torch.Tensor, slots: torch.Tensor) -> None:
        slots, host_rows = slots.to(self.device, torch.int64), host_rows.to("cpu", torch.int64)
        k, v = self.host_k[:, host_rows].to(self.device), self.host_v[:, host_rows].to(self.device)
        for layer, (k_buf, v_buf) in enumerate(zip(self.k_buffers, self.v_buffers, strict=True)):
            k_buf[slots] = k[layer]
            v_buf[slots] = v[layer]
        self.hooks.on_load(host_rows, slots)

    def check_integrity(self, owned: Sequence[torch.Tensor], used_rows: Sequence[int]) -> None:
        num_pages, ps = self.config.num_pages, self.page_size
        owned_slots = (
            torch.cat([s.to("cpu", torch.int64) for s in owned])
            if owned
            else torch.zeros(0, dtype=torch.int64)
        )
        per_page = torch.bincount(owned_slots // ps, minlength=num_pages)
        owned_pages = set(torch.nonzero(per_page).flatten().tolist())
        free_pages = set(self._free_pages)
        assert len(free_pages) == len(self._free_pages), "free list holds a page twice"
        assert free_pages == {p for p in range(num_pages) if self._is_free[p]}, (
            "free list and free flags disagree"
        )
        bad = sorted(p for p in owned_pages if per_page[p] != ps or p == 0)
        both = sorted((owned_pages | self._quarantined) & free_pages)
        lost = sorted(set(range(1, num_pages)) - owned_pages - free_pages - self._quarantined)
        idle_quarantined = self._quarantined - owned_pages  # owned ones leave when their owner frees them
        assert not (bad or both or lost), (
            f"slot conservation broken: free {len(free_pages)} + quarantined {len(idle_quarantined)} + "
            f"owned {len(owned_pages)} pages vs {num_pages - 1} usable; pages owned twice, partly or "
            f"reserved: {bad[:8]}; in two states: {both[:8]}; in no state (leaked): {lost[:8]}"
        )
        used, free_rows = set(used_rows), set(self._free_rows)
        assert (
            len(used) == len(used_rows)
            and not (used & free_rows)
            and used | free_rows == set(range(1, self.config.max_rows))
        ), (
            f"row conservation broken: {len(free_rows)} free + {len(used_rows)} used "
            f"!= {self.config.max_rows - 1} usable rows"
        )
