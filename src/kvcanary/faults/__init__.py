"""Fault injectors: each breaks the KV cache the way a class of real bugs does, through the
engine's public objects and hooks, and records where and when it acted."""

from __future__ import annotations

from kvcanary.faults.base import Expectation, Fault, Injection
from kvcanary.faults.cached_slot_flip import CachedSlotFlip
from kvcanary.faults.hooks import FaultHooks, attach_faults
from kvcanary.faults.page_table_repoint import PageTableRepoint
from kvcanary.faults.stale_slot_reuse import StaleSlotReuse
from kvcanary.faults.used_slot_flip import UsedSlotFlip

FAULTS: dict[str, type[Fault]] = {f.name: f for f in (PageTableRepoint, UsedSlotFlip, CachedSlotFlip, StaleSlotReuse)}

__all__ = ["FAULTS", "CachedSlotFlip", "Expectation", "Fault", "FaultHooks", "Injection", "PageTableRepoint",
           "StaleSlotReuse", "UsedSlotFlip", "attach_faults"]
