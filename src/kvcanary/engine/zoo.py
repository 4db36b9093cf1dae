"""The real-bug zoo: switches that re-create public KV-cache bugs inside the reference engine.

Each ``Bug`` is a switch of ``EngineConfig.bugs`` (all off by default). A switch sits at the place
in the engine where its bug class lives in real engines, acts only under that bug's condition,
and logs every act as a ``ZooEvent`` in ``Engine.zoo`` (so a run can tell the violations the bug
explains from false positives). ``CATALOGUE`` documents each one: the public bug it re-creates,
where its switch is, what it does, and what the canary reports first with every check on (token
truth, ``real_kv`` fingerprints, sweeps). ``kvcanary.runs.campaign`` triggers each one
with a workload and checks that expectation.

The engine runs one step at a time on one stream, so the races (``abort_inflight_write``,
``load_back_unordered``) are re-created deterministically: the switch performs the unordered copy
at the point where the race lets it land (after the new owner's write; after the load-back).

| bug                      | switch in                           | first detection                   |
|--------------------------|-------------------------------------|-----------------------------------|
| abort_inflight_write     | ``Engine.abort``                    | fingerprint @ TAIL                |
| prefix_page_off_by_one   | ``CacheManager.reserve``            | read_conflict @ HEAD              |
| padding_writes_live_slot | ``Engine._padding``                 | fingerprint @ TAIL (or SWEEP)     |
| offload_shared_host_row  | ``HostTier.offload``                | chain+position @ SWEEP (load-back)|
| load_back_unordered      | ``HostTier.load``                   | fingerprint @ SWEEP (load-back)   |
| stale_radix_node         | ``RadixCache.evict``                | chain @ SWEEP                     |
| failed_load_counted      | ``HostTier.load``                   | chain+position @ HEAD (or SWEEP)  |
| reprefill_prompt_only    | ``Scheduler`` (extend, postprocess) | chain @ HEAD                      |
| rejected_draft_kv_cached | ``CacheManager.release``            | verify_token @ SWEEP              |
| partial_page_hit         | ``RadixCache.match``                | verify_token @ HEAD               |
| chunk_positions_restart  | ``build_forward_batch``             | write_position @ HEAD             |

The expectations are what the canary really reported on the triggering workloads (see
``CATALOGUE`` for the reasons that may come along); ``tests/engine/test_zoo.py`` pins them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.config import Bug

if TYPE_CHECKING:
    from kvcanary.engine.pool import KVPool


@dataclass(frozen=True)
class BugInfo:
    """One zoo entry. ``point`` / ``reasons``: the first violation the canary reports (every bit of
    ``reasons`` set; ``optional`` bits may come along; ``also_at``: other launch points that may
    see it first, depending on who reads the damage next); ``needs``: what its trigger needs (the
    switch cannot act, or the canary cannot see it, without)."""

    title: str
    links: tuple[str, ...]
    where: str
    mechanism: str
    point: LaunchPoint
    reasons: Reason
    optional: Reason = Reason(0)
    needs: str = ""
    also_at: tuple[LaunchPoint, ...] = ()


_GH = "https://github.com/"
CATALOGUE: dict[Bug, BugInfo] = {
    Bug.ABORT_INFLIGHT_WRITE: BugInfo(
        "abort frees slots an in-flight write still targets",
        (_GH + "sgl-project/sglang/issues/24527", _GH + "sgl-project/sglang/pull/32564",
         _GH + "vllm-project/vllm/pull/45357"),
        "Engine.abort",
        "An abort frees a running request's slots at once, without waiting for its last K/V write "
        "(an asynchronous step or a prefill->decode transfer). That write lands after the slots were "
        "handed to another request and written by it: at the end of the first step that writes one of "
        "them, the aborted request's K/V overwrites the new owner's. The records stay the new owner's.",
        LaunchPoint.TAIL, Reason.FINGERPRINT, Reason(0), "aborts of running requests; real_kv != none"),
    Bug.PREFIX_PAGE_OFF_BY_ONE: BugInfo(
        "prefix length equal to the page size off by one",
        (_GH + "sgl-project/sglang/issues/22819",),
        "CacheManager.reserve",
        "When a request's cached prefix is exactly one page, the test whether the last prefix page "
        "still has room is off by one (`prefix_len <= page_size`): position page_size is mapped to the "
        "slot after the last prefix slot, the first slot of the next physical page, which another "
        "sequence owns. The request writes its token there, into a slot a request of the same batch "
        "reads: HEAD's write-conflict check names both before the model runs (without it, the owner's "
        "record is replaced by one with the same chain and position but another token).",
        LaunchPoint.HEAD, Reason.READ_CONFLICT, Reason(0),
        "a prefix hit of exactly one page; token truth"),
    Bug.PADDING_WRITES_LIVE_SLOT: BugInfo(
        "padding lanes write K/V into a live slot",
        (_GH + "vllm-project/vllm/issues/43810", _GH + "sgl-project/sglang/pull/32477"),
        "Engine._padding (decode batches padded to EngineConfig.graph_batch_sizes)",
        "Decode batches are padded to a captured batch size; the padding lanes carry slot id -1 "
        "(PADDING_SLOT_ID) instead of the reserved slot 0, and the cache write takes -1 for the last "
        "slot of the pool. Whoever holds that slot gets the padding lane's K/V under its own record.",
        LaunchPoint.TAIL, Reason.FINGERPRINT, Reason(0), "graph_batch_sizes; real_kv != none",
        also_at=(LaunchPoint.SWEEP,)),  # SWEEP when the last slot is held by an idle prefix-cache node
    Bug.OFFLOAD_SHARED_HOST_ROW: BugInfo(
        "two slots offloaded into one host row in one step",
        (_GH + "NVIDIA/TensorRT-LLM/issues/8813",),
        "HostTier.offload",
        "The host row cursor is read twice before it advances: the last two slots of an offloaded "
        "node are copied into the same host row (K/V and the records travelling with them), so the "
        "row keeps the last slot's. On load-back both positions hold that one slot's record.",
        LaunchPoint.SWEEP, Reason.CHAIN | Reason.POSITION, Reason(0), "a host tier with load-backs"),
    Bug.LOAD_BACK_UNORDERED: BugInfo(
        "load-back not ordered after the step that freed its target",
        (_GH + "vllm-project/vllm/issues/47282", _GH + "vllm-project/vllm/issues/45704"),
        "HostTier.load",
        "A load-back whose target slots were freed by offloading another node in the same step "
        "is not ordered after that offload's device-to-host copy (a write-after-read race between "
        "the copy streams): the offload reads the loaded K/V instead of its own. The offloaded node's "
        "host rows keep its records but now hold other K/V; its own load-back shows it.",
        LaunchPoint.SWEEP, Reason.FINGERPRINT, Reason(0), "a host tier under memory pressure; real_kv != none"),
    Bug.STALE_RADIX_NODE: BugInfo(
        "radix node left pointing at slots that eviction freed",
        (_GH + "sgl-project/sglang/pull/22592", _GH + "sgl-project/mini-sglang/pull/142"),
        "RadixCache.evict",
        "Eviction frees a dropped leaf's slots and takes it off the eviction list but leaves it in "
        "its parent's children: later prefix hits read slots the allocator has handed to others.",
        LaunchPoint.SWEEP, Reason.CHAIN, Reason.POSITION | Reason.VERIFY_TOKEN | Reason.FINGERPRINT,
        "eviction that drops nodes (no host tier)"),
    Bug.FAILED_LOAD_COUNTED: BugInfo(
        "failed load-back counted as loaded",
        (_GH + "ai-dynamo/dynamo/issues/15079",),
        "HostTier.load",
        "Every other load-back read fails, the first one included (neither the K/V nor the records "
        "reach the device), but the node is marked loaded: its fresh slots keep whatever they held, "
        "and the request that matched it reads them as its prefix.",
        LaunchPoint.HEAD, Reason.CHAIN | Reason.POSITION, Reason.VERIFY_TOKEN | Reason.WRITE_POSITION,
        "a host tier with load-backs", also_at=(LaunchPoint.SWEEP,)),  # SWEEP when the admission then failed
    Bug.REPREFILL_PROMPT_ONLY: BugInfo(
        "re-prefill after preemption indexes only the prompt",
        (_GH + "sgl-project/sglang/issues/14109", _GH + "sgl-project/sglang/issues/12722"),
        "Scheduler._extend_len and Scheduler.postprocess",
        "A preempted request re-prefills from its prompt alone, then its outputs' positions are "
        "taken as computed: they map to fresh slots nobody wrote, and its next decode reads them.",
        LaunchPoint.HEAD, Reason.CHAIN, Reason.POSITION | Reason.VERIFY_TOKEN | Reason.WRITE_POSITION,
        "preemption of requests with >= 2 outputs"),
    Bug.REJECTED_DRAFT_KV_CACHED: BugInfo(
        "draft tokens' KV left in the cache after rejection",
        (_GH + "vllm-project/vllm/issues/14649", _GH + "sgl-project/sglang/pull/11231"),
        "CacheManager.release",
        "With speculative decoding, a request that finishes right after a rejection is cached up to "
        "the slots it holds instead of the K/V it committed: its last position's slot, written by the "
        "rejected draft, enters the prefix cache as the accepted token's K/V. The record is "
        "self-consistent (the draft's token, chained and fingerprinted); only the token truth differs.",
        LaunchPoint.SWEEP, Reason.VERIFY_TOKEN, Reason(0), "num_draft_tokens > 0 (oracle sampler); token truth"),
    Bug.PARTIAL_PAGE_HIT: BugInfo(
        "prefix-cache hit that skips the last partial page check",
        (_GH + "sgl-project/sglang/pull/28692",),
        "RadixCache.match",
        "When no cached page matches the next page of tokens, a page whose first token matches is "
        "taken anyway: the request reads K/V of tokens it does not have. The records are the other "
        "sequence's, consistent among themselves; the tokens differ.",
        LaunchPoint.HEAD, Reason.VERIFY_TOKEN, Reason(0), "page_size > 1; token truth"),
    Bug.CHUNK_POSITIONS_RESTART: BugInfo(
        "prefill chunk positions counted from the chunk, not the sequence",
        (_GH + "huggingface/transformers/issues/43082",),
        "build_forward_batch",
        "The positions of a prefill extend that continues a prefix (a later chunk, or a prefix-cache "
        "hit) restart at 0: the K/V lands in the right slots but is computed (RoPE) and stamped at "
        "the wrong positions.",
        LaunchPoint.HEAD, Reason.WRITE_POSITION, Reason(0), "chunked prefill or prefix hits"),
}


@dataclass(frozen=True)
class ZooEvent:
    """One act of a switch: the slots and host rows whose contents or records it made wrong, and
    for request-scoped acts the request and the positions it got wrong."""

    bug: Bug
    detail: str
    slots: tuple[int, ...] = ()
    host_rows: tuple[int, ...] = ()
    request_id: int | None = None
    positions: tuple[int, ...] = ()


class Zoo:
    """The switches an engine runs with, and the log of their acts (``events``, append-only)."""

    def __init__(self, bugs: Iterable[Bug] = ()):
        self.bugs = frozenset(bugs)
        self.events: list[ZooEvent] = []

    def __contains__(self, bug: Bug) -> bool:
        return bug in self.bugs

    def record(self, bug: Bug, detail: str, slots: Sequence[int] | torch.Tensor = (),
               host_rows: Sequence[int] | torch.Tensor = (), request_id: int | None = None,
               positions: Sequence[int] = ()) -> None:
        as_ints = lambda xs: tuple(int(x) for x in (xs.tolist() if isinstance(xs, torch.Tensor) else xs))
        self.events.append(ZooEvent(bug, detail, as_ints(slots), as_ints(host_rows), request_id, tuple(positions)))


@dataclass
class InFlightWrite:
    """The K/V an aborted request's last write still carries (``Bug.ABORT_INFLIGHT_WRITE``):
    captured at the abort, landed into ``slots`` later."""

    slots: torch.Tensor  # int64[n], on the pool's device
    k: list[torch.Tensor] = field(default_factory=list)  # per layer [n, kv_heads, head_dim]
    v: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls, pool: KVPool, slots: torch.Tensor) -> InFlightWrite:
        slots = slots.to(pool.device, torch.int64)
        return cls(slots, [k[slots].clone() for k in pool.k_buffers], [v[slots].clone() for v in pool.v_buffers])

    def land(self, pool: KVPool) -> None:
        for k_buf, v_buf, k, v in zip(pool.k_buffers, pool.v_buffers, self.k, self.v, strict=True):
            k_buf[self.slots] = k
            v_buf[self.slots] = v
