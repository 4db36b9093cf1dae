"""Holds: the idle prefix-cache slots the next HEAD must not see written (READ_CONFLICT naming
the cache, row 0), at most one step's.

Where HEAD is the Triton check, the held slots are read counted on the device (``ops.conflicts``:
the count, then the slots; every slot at most once, as a prefix cache holds each slot in one
place), by an eager HEAD or one replayed from a graph, which zeroes the count once read; on CUDA
host slots reach those words from the canary's own pinned words in one copy, never waiting for
queued device work. Elsewhere the held slots are a plain int64 tensor HEAD reads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvcanary.ops.state import DeviceState


class Holds:
    """The held slots of one canary (see the module doc). ``counted``: HEAD is the Triton check,
    which reads them as counted words on the device."""

    def __init__(self, state: DeviceState, counted: bool):
        self.state = state
        self.num_slots = state.num_slots
        dev = state.device
        # set: a hold no HEAD has consumed yet; with counted words a view of the slots in them
        self.held: torch.Tensor | None = None
        self.counted = torch.zeros(1 + self.num_slots, dtype=torch.int64, device=dev) if counted else None
        self._pinned = (torch.zeros(1 + self.num_slots, dtype=torch.int64, pin_memory=True),
                        torch.cuda.Event()) if counted and dev.type == "cuda" else None

    def hold(self, slots: torch.Tensor) -> None:
        """Hold ``slots`` (int64, this pool's numbering) for the next HEAD."""
        dev = self.state.device
        words = self.counted
        if words is not None:
            slots = slots.reshape(-1)
            if slots.device.type == "cpu":
                self.hold_host(slots.to(torch.int64).numpy())
                return
            if slots.shape[0] >= words.shape[0]:  # more than the words hold: each slot of the pool once (a sync)
                slots = slots.to(dev, torch.int64)
                slots = torch.unique(slots[(slots > 0) & (slots < self.num_slots)])
            n = slots.shape[0]
            words[1: 1 + n].copy_(slots)  # on the current stream, from this or another device
            words[:1].fill_(n)
            self.held = words[1: 1 + n]
            return
        if dev.type != "cuda" or slots.is_cuda or torch.cuda.current_stream(dev).query():
            self.held = slots.to(dev, torch.int64).contiguous()
        else:  # pinned by torch's caching host allocator, which keeps the block until the copy has read it
            self.held = slots.reshape(-1).to(torch.int64).pin_memory().to(dev, non_blocking=True)

    def hold_host(self, slots: np.ndarray) -> None:
        """``hold`` of host slots (an int64 array nobody writes): into the counted words, on CUDA
        through the canary's own pinned words, one copy of the count and the slots (the last one
        has long been read)."""
        words = self.counted
        if words is None:
            self.hold(torch.from_numpy(slots))
            return
        if len(slots) >= words.shape[0]:  # more than the words hold (a cache holding a slot twice): each once
            slots = np.asarray(slots, dtype=np.int64)
            slots = np.unique(slots[(slots > 0) & (slots < self.num_slots)])
        n = len(slots)
        if self._pinned is None:  # the CPU (the interpreter): the words themselves
            host = words.numpy()
            host[1: 1 + n] = slots
            host[0] = n
        else:
            pinned, event = self._pinned
            event.synchronize()
            host = pinned.numpy()
            host[0] = n
            host[1: 1 + n] = slots
            words[: 1 + n].copy_(pinned[: 1 + n], non_blocking=True)
            event.record()
        self.held = words[1: 1 + n]

    def hold_replayed(self, n: int, replayed: torch.Tensor, every: Callable[[], np.ndarray]) -> None:
        """``hold`` of the ``n`` slots a sweep's graphs just loaded: their count and slots, as the
        replay left them in ``replayed``, copied into the counted words on the device (one copy);
        where they are more than the words hold (a cache holding a slot twice), ``every()``'s,
        each once."""
        words = self.counted
        if n >= words.shape[0]:
            self.hold_host(every())
            return
        words[: 1 + n].copy_(replayed[: 1 + n])
        self.held = words[1: 1 + n]

    def now(self, capturing: bool) -> torch.Tensor | None:
        """The held slots for this HEAD: the counted words where a hold waits, and always in a
        capture, so that each replay checks the slots held in its own step (none where the count
        is 0); elsewhere ``held``. ``capturing``: whether the current stream is capturing."""
        words = self.counted
        if words is None:
            return self.held
        return words if capturing or self.held is not None else None

    def drop(self) -> None:
        """The end of a step: held slots are one step's (a hold no eager HEAD read is zeroed; a
        replay's HEAD read it, or none ran)."""
        if self.held is not None and self.counted is not None:
            self.counted[:1].zero_()
        self.held = None
