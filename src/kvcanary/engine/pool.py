"""The paged KV pool: K/V buffers, the slot allocator, the page table and host storage.

Slot ``s`` lives on page ``s // page_size``. Page 0 is reserved (padding writes land in slot
0), and so is page-table row 0. Allocation is by whole pages, first-in first-out.

Ownership of every usable page, checked by ``check_integrity``:

| state        | held by                                                   |
|--------------|-----------------------------------------------------------|
| free         | the allocator (handed out again)                          |
| quarantined  | nobody, ever again (``quarantine``: suspected corruption) |
| owned        | exactly one prefix-cache node or one request              |

A page quarantined while owned stays owned until its owner frees it (a running reader is not cut
off; ``CacheManager.release`` never caches it), then stays out (``hooks.on_retire``: its incidents
close): a bug that keeps hitting one place (a padding lane's fixed slot) hits it once, and the
recompute guarantee holds (``tests/faults/test_delivery.py``). Under the log policy, which must
keep serving, a page is quarantined only until its owner frees it (``retire=False``): it returns
to the free list then, so a recurring bug cannot drain the pool.

A model with sliding-window layers keeps their K/V in a second, smaller pool (``WindowPool``):
only positions inside some request's window hold a window slot, found through the full-slot ->
window-slot table ``WindowPool.lut`` (0 = no window slot: evicted or out of every window). A
layer's buffers in ``k_buffers`` / ``v_buffers`` are addressed by full slot for a full-attention
layer and by window slot for a window layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.hooks import EngineHooks


class KVPoolBase(ABC):
    """What the engine needs from a paged KV pool. Side effects are listed per method."""

    page_size: int
    req_to_token: torch.Tensor  # int32[max_rows, max_ctx], (row, position) -> slot
    k_buffers: list[torch.Tensor]  # per layer [num_slots, num_kv_heads, head_dim] (window layers: window slots)
    v_buffers: list[torch.Tensor]
    window: WindowPool | None = None  # the sliding-window layers' pool, if the model has any

    @abstractmethod
    def alloc(self, num_slots: int) -> torch.Tensor | None:
        """Take ``num_slots`` (a page multiple) from the free list: int64[num_slots] on the CPU,
        whole pages in order, or None (nothing taken) when too few are free."""

    @abstractmethod
    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages to the free list (quarantined pages stay out), then call
        ``hooks.on_free`` with the returned slots and ``hooks.on_retire`` with the quarantined ones."""

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


def window_pool_slots(model_config: ModelConfig, config: EngineConfig) -> int:
    """Window-pool size: ``config.window_slots``, or when 0 what the running requests can hold at
    once (each: its window twice over, once in its own slots and once in a cached prefix it
    reads; plus one step's tokens and the reserved slot), at most the full pool's size."""
    if config.window_slots:
        return config.window_slots
    w, ps = model_config.sliding_window, config.page_size
    return min(config.num_slots, 1 + config.max_running * 2 * (w + ps) + config.max_tokens_per_step + ps)


class WindowPool:
    """K/V of the sliding-window layers for positions inside a window, and the full-slot ->
    window-slot table. Window slots are handed out one at a time (slot 0 reserved) and reused as
    windows slide.

    ``lut``: int64[full num_slots] on the pool's device, 0 = no window slot. Counters:
    ``num_mapped`` (positions given a window slot), ``num_translated`` (of those, at a window
    slot number other than their full slot), ``num_slid_out`` (positions taken back after they
    left their request's window), ``num_dropped`` (cached positions whose window slot was taken
    back while their full K/V stayed cached), ``num_reused`` (window slots handed out again).
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig, device: torch.device):
        self.window, self.layers = model_config.sliding_window, model_config.window_layers
        self.num_slots = window_pool_slots(model_config, config)
        shape = (self.num_slots, model_config.num_kv_heads, model_config.head_dim)
        make = lambda: torch.zeros(shape, dtype=model_config.dtype, device=device)
        self.k_buffers = {layer: make() for layer in self.layers}
        self.v_buffers = {layer: make() for layer in self.layers}
        self.lut = torch.zeros(config.num_slots, dtype=torch.int64, device=device)
        self._lut = torch.zeros(config.num_slots, dtype=torch.int64)  # host mirror: bookkeeping without syncs
        self._free = deque(range(1, self.num_slots))
        self._ever_used = [False] * self.num_slots
        self.num_mapped = self.num_translated = self.num_slid_out = self.num_dropped = self.num_reused = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Window slots of ``full_slots`` (int64, CPU; 0 where none), from the host mirror."""
        return self._lut[full_slots.to("cpu", torch.int64)]

    def num_unmapped(self, full_slots: torch.Tensor) -> int:
        return int((self.translate(full_slots) == 0).sum())

    def map(self, full_slots: torch.Tensor) -> bool:
        """Give every slot of ``full_slots`` (> 0) that has none a window slot; False (nothing
        changed) when too few are free. Updates ``lut``."""
        full = full_slots.to("cpu", torch.int64)
        full = torch.unique(full[(full > 0) & (self._lut[full.clamp(min=0)] == 0)])
        n = full.numel()
        if n > len(self._free):
            return False
        if n == 0:
            return True
        win = torch.tensor([self._free.popleft() for _ in range(n)], dtype=torch.int64)
        self.num_reused += sum(self._ever_used[w] for w in win.tolist())
        for w in win.tolist():
            self._ever_used[w] = True
        self._lut[full] = win
        self.lut[full.to(self.lut.device)] = win.to(self.lut.device)
        self.num_mapped += n
        self.num_translated += int((win != full).sum())
        return True

    def unmap(self, full_slots: torch.Tensor, slid: bool = False, dropped: bool = False) -> int:
        """Release the window slots of ``full_slots`` (those that have one); ``slid``: they left
        their request's window (``num_slid_out``); ``dropped``: cached positions whose full K/V
        stays (``num_dropped``). Returns the number released."""
        full = full_slots.to("cpu", torch.int64)
        full = torch.unique(full[(full > 0) & (full < self._lut.numel())])
        full = full[self._lut[full] != 0]
        if full.numel() == 0:
            return 0
        self._free.extend(self._lut[full].tolist())
        self._lut[full] = 0
        self.lut[full.to(self.lut.device)] = 0
        self.num_slid_out += full.numel() if slid else 0
        self.num_dropped += full.numel() if dropped else 0
        return full.numel()

    def full_slots_of(self, window_slots: Sequence[int]) -> list[int]:
        """The full slots now mapped to ``window_slots`` (those that are mapped)."""
        mapped = torch.nonzero(self._lut).flatten()
        owner = dict(zip(self._lut[mapped].tolist(), mapped.tolist(), strict=True))
        return [owner[w] for w in window_slots if w in owner]

    def counters(self) -> dict[str, int]:
        return {"window": self.window, "window_slots": self.num_slots, "mapped_positions": self.num_mapped,
                "translated_positions": self.num_translated, "slid_out_positions": self.num_slid_out,
                "dropped_cached_positions": self.num_dropped,
                "reused_window_slots": self.num_reused, "resident_positions": int((self._lut != 0).sum())}

    def check_integrity(self, free_full_slots: set[int]) -> None:
        """Assert window-slot conservation (free + mapped == usable, each mapped once), the device
        table equals its host mirror, and no free full slot keeps a window slot."""
        mapped = torch.nonzero(self._lut).flatten()
        win = self._lut[mapped].tolist()
        free = list(self._free)
        assert len(set(win)) == len(win), "a window slot is mapped from two full slots"
        assert sorted(win + free) == list(range(1, self.num_slots)), (
            f"window-slot conservation broken: {len(free)} free + {len(win)} mapped != {self.num_slots - 1}"
        )
        assert torch.equal(self.lut.cpu(), self._lut), "window table on the device != its host mirror"
        stale = sorted(set(mapped.tolist()) & free_full_slots)
        assert not stale, f"free full slots still hold window slots: {stale[:8]}"


class KVPool(KVPoolBase):
    def __init__(self, model_config: ModelConfig, config: EngineConfig, hooks: EngineHooks):
        self.config, self.hooks = config, hooks
        self.page_size = config.page_size
        self.num_slots = config.num_slots
        self.device = torch.device(config.device)
        shape = (config.num_slots, model_config.num_kv_heads, model_config.head_dim)
        make = lambda: torch.zeros(shape, dtype=model_config.dtype, device=self.device)
        self.window = WindowPool(model_config, config, self.device) if model_config.window_layers else None
        self.full_layers = model_config.full_layers
        layers = range(model_config.num_layers)
        self.k_buffers = [self.window.k_buffers[x] if x not in self.full_layers else make() for x in layers]
        self.v_buffers = [self.window.v_buffers[x] if x not in self.full_layers else make() for x in layers]
        self.req_to_token = torch.zeros(
            config.max_rows, config.max_ctx, dtype=torch.int32, device=self.device
        )
        host_shape = (model_config.num_layers, config.host_tier_slots, *shape[1:])
        pin = self.device.type == "cuda"
        self.host_k = torch.zeros(host_shape, dtype=model_config.dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_shape, dtype=model_config.dtype, pin_memory=pin)
        # a window layer's host row holds the slot's window K/V, when it had a window slot
        self.host_has_window = torch.zeros(config.host_tier_slots, dtype=torch.bool)
        # what an offload and a load-back move for the full layers, as (device, host) uint8 rows of
        # one slot / one host row each: their K and V, then the rows of ``move_with_kv``
        width = shape[1] * shape[2] * self.host_k.element_size()
        self._moved = [(dev.view(torch.uint8).view(config.num_slots, width),
                        host[x].view(torch.uint8).view(config.host_tier_slots, width))
                       for x in self.full_layers
                       for dev, host in ((self.k_buffers[x], self.host_k), (self.v_buffers[x], self.host_v))]
        self._free_pages = deque(range(1, config.num_pages))
        self._is_free = [False] + [True] * (config.num_pages - 1)
        self._quarantined: set[int] = set()
        self._until_free: set[int] = set()  # quarantined until their owner frees them (``quarantine(retire=False)``)
        self._free_rows = deque(range(1, config.max_rows))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_quarantined_slots(self) -> int:
        return (len(self._quarantined) + len(self._until_free)) * self.page_size

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
        if self.window is not None:
            self.window.unmap(slots)
        returned, retired = [], []
        for p in self._pages_of(slots):
            assert 0 < p < len(self._is_free) and not self._is_free[p], f"double free or bad page {p}"
            if p in self._quarantined:
                retired.append(p)
                continue
            self._until_free.discard(p)
            self._is_free[p] = True
            self._free_pages.append(p)
            returned.append(p)
        for pages, hook in ((returned, self.hooks.on_free), (retired, self.hooks.on_retire)):
            if pages:
                first = torch.tensor(pages, dtype=torch.int64) * self.page_size
                hook((first[:, None] + torch.arange(self.page_size)).flatten().to(self.device))

    @property
    def quarantined_pages(self) -> set[int]:
        """Every quarantined page (retired or until freed)."""
        return self._quarantined | self._until_free

    def is_quarantined(self, slot: int) -> bool:
        page = slot // self.page_size
        return page in self._quarantined or page in self._until_free

    def quarantine(self, slots: torch.Tensor, retire: bool = True) -> int:
        """Never hand out the pages of ``slots`` again. Free pages leave the free list now; owned
        ones are kept out when their owner frees them. Without ``retire`` (the log policy) only
        owned pages are marked, until their owner frees them: they return to the free list then.
        Returns the number of newly quarantined pages."""
        pages = set((slots.to("cpu", torch.int64) // self.page_size).tolist()) - {0} - self._quarantined
        if not retire:
            pages = {p for p in pages - self._until_free if not self._is_free[p]}
            self._until_free |= pages
            return len(pages)
        num_new = len(pages - self._until_free)
        self._until_free -= pages
        for p in pages:
            if self._is_free[p]:
                self._free_pages.remove(p)
                self._is_free[p] = False
        self._quarantined |= pages
        return num_new

    def alloc_row(self) -> int | None:
        return self._free_rows.popleft() if self._free_rows else None

    def free_row(self, row: int) -> None:
        assert 0 < row < self.config.max_rows and row not in self._free_rows, f"double free of row {row}"
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    def move_with_kv(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Per-slot rows that an offload and a load-back move with the full layers' K/V, in the
        same copy: (device, host) uint8 pairs, [num_slots, w] on the pool's device and
        [host_tier_slots, w] on the host (a canary's ``row_pairs``)."""
        for i, (dev, host) in enumerate(pairs):
            want = ((self.num_slots, "num_slots", dev, self.device.type), (self.config.host_tier_slots,
                                                                          "host_tier_slots", host, "cpu"))
            for n, what, t, where in want:
                if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[0] != n or t.device.type != where:
                    raise ValueError(f"move_with_kv pairs[{i}]: want uint8[{what} = {n}, w] on {where}, got "
                                     f"{t.dtype}{list(t.shape)} on {t.device}")
            if dev.shape[1] != host.shape[1]:
                raise ValueError(f"move_with_kv pairs[{i}]: device rows of {dev.shape[1]} bytes != host rows of "
                                 f"{host.shape[1]}")
        self._moved += [tuple(p) for p in pairs]

    def copy_to_host(self, slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Full layers (and the rows of ``move_with_kv``) from ``slots``, in one gather and one copy
        to the host; window layers from the window slots of those that have one. The hooks get the
        slots on the host (as the host tier keeps them): a canary checks and indexes them there,
        with no copy back from the device."""
        host_slots, host_rows = slots.to("cpu", torch.int64), host_rows.to("cpu", torch.int64)
        slots = host_slots.to(self.device)
        rows = host_rows.numpy()
        self.hooks.before_move()
        staged = torch.cat([dev[slots] for dev, _ in self._moved], dim=1).cpu().numpy()
        at = 0
        for _, host in self._moved:
            w = host.shape[1]
            host.numpy()[rows] = staged[:, at: at + w]
            at += w
        if self.window is not None:
            win = self.window.translate(host_slots)
            has = win > 0
            self.host_has_window[host_rows] = has
            if bool(has.any()):
                src, rows = win[has].to(self.device), host_rows[has]
                for x in self.window.layers:
                    self.host_k[x, rows] = self.k_buffers[x][src].cpu()
                    self.host_v[x, rows] = self.v_buffers[x][src].cpu()
        self.hooks.on_offload(host_slots, host_rows)

    def copy_from_host(self, host_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Full layers (and the rows of ``move_with_kv``) into ``slots``, in one copy to the device
        and a write per buffer; window layers into fresh window slots for the rows that hold
        window K/V, when the window pool has room for all of them (else they get none). The hooks
        get the slots on the host, as ``copy_to_host``'s do."""
        host_slots, host_rows = slots.to("cpu", torch.int64), host_rows.to("cpu", torch.int64)
        slots = host_slots.to(self.device)
        rows = host_rows.numpy()
        self.hooks.before_move()
        staged = torch.from_numpy(np.concatenate([host.numpy()[rows] for _, host in self._moved], axis=1))
        staged = staged.to(self.device)
        at = 0
        for dev, host in self._moved:
            w = host.shape[1]
            dev[slots] = staged[:, at: at + w]
            at += w
        if self.window is not None:
            want = self.host_has_window[host_rows]
            if bool(want.any()) and self.window.map(host_slots[want]):
                dst, rows = self.window.translate(host_slots[want]).to(self.device), host_rows[want]
                for x in self.window.layers:
                    self.k_buffers[x][dst] = self.host_k[x, rows].to(self.device)
                    self.v_buffers[x][dst] = self.host_v[x, rows].to(self.device)
        self.hooks.on_load(host_rows, host_slots)

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
        lost += sorted(self._until_free - owned_pages)  # (quarantined until freed, but owned by nobody)
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
        if self.window is not None:
            ps = self.page_size
            self.window.check_integrity({p * ps + i for p in free_pages for i in range(ps)})
