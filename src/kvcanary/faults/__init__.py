"""Fault injectors: each breaks the KV cache the way a class of real bugs does, through the
engine's public objects and hooks, and records where and when it acted.

``FAULTS`` holds the injectors the reference engine can host with any model, in the order of
DESIGN.md §7; ``WINDOW_FAULTS`` those that need a model with sliding-window layers
(``--model hybrid-swa``); ``PD_FAULTS`` those that act on the prefill/decode transfer
(``kv-canary run --pd``, judged on the decode side); ``PENDING_FAULTS`` those that wait for an
engine feature (their ``pending`` says which).
"""

from __future__ import annotations

from kvcanary.faults.base import Expectation, Fault, Injection
from kvcanary.faults.cached_slot_flip import CachedSlotFlip
from kvcanary.faults.chunk_boundary_token import ChunkBoundaryToken
from kvcanary.faults.dropped_kv_write import DroppedKVWrite
from kvcanary.faults.hooks import FaultHooks, attach_faults
from kvcanary.faults.host_row_flip import HostRowFlip
from kvcanary.faults.host_row_mismatch import HostRowMismatch
from kvcanary.faults.page_table_bad_entry import PageTableBadEntry
from kvcanary.faults.page_table_repoint import PageTableRepoint
from kvcanary.faults.position_skew import PositionSkew
from kvcanary.faults.prefill_after_check import PrefillAfterCheck
from kvcanary.faults.sampled_token_swap import SampledTokenSwap
from kvcanary.faults.sliding_window_lut import SlidingWindowLut
from kvcanary.faults.stale_slot_reuse import StaleSlotReuse
from kvcanary.faults.stale_transfer_write import StaleTransferWrite
from kvcanary.faults.stamp_corruption import StampCorruption, StampField
from kvcanary.faults.transfer_byte_flip import TransferByteFlip
from kvcanary.faults.transfer_wrong_slot import TransferWrongSlot
from kvcanary.faults.used_slot_flip import UsedSlotFlip
from kvcanary.faults.write_target_duplicate import WriteTargetDuplicate
from kvcanary.faults.written_slot_flip import WrittenSlotFlip
from kvcanary.faults.wrong_layer_write import WrongLayerWrite

FAULTS: dict[str, type[Fault]] = {f.name: f for f in (
    PageTableRepoint, UsedSlotFlip, CachedSlotFlip, WrittenSlotFlip, SampledTokenSwap, PositionSkew,
    ChunkBoundaryToken, StampCorruption, HostRowFlip, HostRowMismatch, StaleSlotReuse, PageTableBadEntry,
    WriteTargetDuplicate, DroppedKVWrite, WrongLayerWrite)}
WINDOW_FAULTS: dict[str, type[Fault]] = {f.name: f for f in (SlidingWindowLut,)}
PD_FAULTS: dict[str, type[Fault]] = {f.name: f for f in (
    TransferByteFlip, TransferWrongSlot, StaleTransferWrite, PrefillAfterCheck)}
PENDING_FAULTS: dict[str, type[Fault]] = {}

__all__ = ["FAULTS", "PD_FAULTS", "PENDING_FAULTS", "WINDOW_FAULTS", "CachedSlotFlip", "ChunkBoundaryToken",
           "DroppedKVWrite", "Expectation", "Fault", "FaultHooks", "HostRowFlip", "HostRowMismatch", "Injection",
           "PageTableBadEntry", "PageTableRepoint",
           "PositionSkew", "PrefillAfterCheck", "SampledTokenSwap", "SlidingWindowLut", "StaleSlotReuse",
           "StaleTransferWrite", "StampCorruption", "StampField", "TransferByteFlip", "TransferWrongSlot",
           "UsedSlotFlip", "WriteTargetDuplicate", "WrittenSlotFlip", "WrongLayerWrite", "attach_faults"]
