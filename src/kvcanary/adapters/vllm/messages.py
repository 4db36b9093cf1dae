"""What the adapter's two halves send each other through vLLM, and the counters it exports.

The scheduler's half runs in the engine-core process, the workers' halves in the worker
processes (one process for all three in single-process mode); vLLM pickles these between them.

| message          | from -> to          | carries                                                          |
|------------------|---------------------|------------------------------------------------------------------|
| ``StepMessage``  | scheduler -> worker | per scheduled request: its canary row, where its truth starts and |
|                  | (connector metadata)| the token ids from there, the blocks it was given; blocks handed  |
|                  |                     | out fresh; requests gone; sweep runs; the layout of its blocks    |
| ``WorkerReport`` | worker -> scheduler | blocks found damaged (to leave the prefix cache), requests that   |
|                  | (worker metadata)   | read them                                                         |
| ``CanaryStats``  | worker -> frontend  | counters for vLLM's Prometheus metrics (``kvcanary_*``)           |
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcanary.core.record import RECORD_VERSION
from kvcanary.runtime.signature import LayoutSignature, dtype_name

# what a StepMessage's block ids and token ids mean, per KV cache group; the workers' canaries choose
# the layers, halves and fingerprint mode they cover themselves (no record travels in a message)
BLOCK_FIELDS = ("record_version", "page_size", "dtype", "num_kv_heads", "head_dim", "model")


def block_layout(block_size: int, num_kv_heads: int, head_dim: int, dtype, model: str | None) -> LayoutSignature:
    """The layout signature of one KV cache group's blocks as the scheduler sends them (the
    ``BLOCK_FIELDS``; layers, halves and fingerprint mode None: not the scheduler's to decide)."""
    return LayoutSignature(RECORD_VERSION, None, None, block_size, dtype_name(dtype), num_kv_heads, head_dim, None,
                           model)


def layout_words(signature: LayoutSignature) -> tuple:
    """The ``BLOCK_FIELDS`` of ``signature`` as a plain tuple: what a StepMessage carries (a tuple
    of ints and strings pickles and compares in well under a microsecond; a dataclass costs ~20 µs
    a step between processes)."""
    return tuple(getattr(signature, name) for name in BLOCK_FIELDS)


def layout_of_words(words: tuple) -> LayoutSignature:
    """The signature a StepMessage's layout words stand for (``layout_words`` reversed)."""
    return LayoutSignature(**dict(zip(BLOCK_FIELDS, words, strict=True)), layers=None, halves=None, fingerprint=None)


@dataclass
class StepMessage(KVConnectorMetadata):
    step: int
    # request id -> (canary row, position its truth tokens start at, the token ids from there on)
    requests: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)
    fresh_blocks: list[list[int]] = field(default_factory=list)  # per KV cache group
    # request id -> (True: its whole block list, False: blocks appended to it) per KV cache group
    blocks: dict[str, tuple[bool, list[list[int]]]] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)  # requests that finished or were preempted
    # runs of cached blocks to sweep from position 0: (run id, blocks, their tokens, or None where the
    # workers hold them from an earlier sweep); runs the workers may forget
    sweep: list[tuple[str, list[int], list[int] | None]] = field(default_factory=list)
    sweep_dropped: list[str] = field(default_factory=list)
    # per KV cache group, what its block ids mean (``layout_words`` of its ``block_layout``); a worker
    # refuses a message whose layout differs from its own before it touches anything
    layout: tuple[tuple, ...] = ()


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    damaged: dict[int, set[int]] = field(default_factory=dict)  # KV cache group -> damaged block ids
    readers: set[str] = field(default_factory=set)  # requests whose forward read or wrote the damage

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        damaged = {g: set(b) for g, b in self.damaged.items()}
        for g, blocks in other.damaged.items():
            damaged.setdefault(g, set()).update(blocks)
        return WorkerReport(damaged, self.readers | other.readers)

    def is_empty(self) -> bool:
        return not self.damaged and not self.readers


# counter names in CanaryStats.data; violations are keyed "violations|<reasons>|<launch point>"
COUNTERS = ("forwards", "sweeps", "incidents", "quarantined_blocks", "recovered_requests")


@dataclass
class CanaryStats(KVConnectorStats):
    """Counter increments since the last read, summed over workers and intervals."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> CanaryStats:
        total = Counter(self.data)
        total.update(other.data)
        return CanaryStats(data=dict(total))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @staticmethod
    def violation_key(reasons: str, point: str) -> str:
        return f"violations|{reasons}|{point}"

    def violations(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], Any] = {}
        for key, n in self.data.items():
            if key.startswith("violations|"):
                _, reasons, point = key.split("|")
                out[(reasons, point)] = n
        return out
