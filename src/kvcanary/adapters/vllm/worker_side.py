"""The worker half of the adapter: one Canary per KV cache group, HEAD and TAIL around vLLM's forward.

Per forward (``around_forward``, called by the model runner's ``_model_forward`` while the
adapter is installed):

1. the blocks the scheduler handed out fresh this step are told to each canary as freed (their
   old incidents close; a reused block is never flagged for having been reused);
2. a due sweep verifies idle prefix-cache blocks the scheduler named (within the byte budget);
3. each group's ``ForwardBatch`` is built from what attention will really use: the model's input
   ids and positions, the group's attention metadata (block table, slot mapping, query and
   sequence lengths) and the scheduler's token ids as truth;
4. HEAD on entering ``canary.forward``, the model, TAIL on leaving, then ``end_step``.

The page table is the group's block table expanded to slots (``slot = block * block_size +
offset``) in a table of the adapter's own rows (a request keeps its row while it runs, whatever
its index in vLLM's persistent batch). Only blocks whose id changed since the row's last forward
are expanded again, so the host work a step grows with the blocks a step adds or changes, and
truth is sent as appends (a request's history once, then its new tokens).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from kvcanary import Canary, ForwardBatch, PoolGeometry, PoolKind, Reason, SweepRun
from kvcanary.adapters.vllm.layouts import (
    Geometry,
    Layout,
    covers_all_heads,
    detect_layout,
    fingerprintable,
    num_blocks_of,
    sources_for,
)
from kvcanary.adapters.vllm.messages import (
    BLOCK_FIELDS,
    CanaryStats,
    StepMessage,
    WorkerReport,
    block_layout,
    layout_of_words,
    layout_words,
)
from kvcanary.adapters.vllm.settings import AdapterSettings
from kvcanary.errors import KVCanaryError
from kvcanary.runtime.signature import LayoutSignature

log = logging.getLogger("kvcanary")


@dataclass
class GroupSpec:
    """What the adapter needs of one vLLM KV cache group."""

    index: int
    layer_names: list[str]
    block_size: int
    num_heads: int
    head_dim: int
    window: int = 0  # sliding window in tokens (0: full attention)
    dtype: str | None = None  # the K/V dtype
    model: str | None = None  # the model's identity (``checks.model_identity``)

    def layout(self) -> LayoutSignature:
        """What this group's block ids mean (``messages.block_layout``): the scheduler sends it with
        every step, the worker compares it with its own."""
        return block_layout(self.block_size, self.num_heads, self.head_dim, self.dtype, self.model)


@dataclass
class StepView:
    """What a fault hook may read or change at a launch point (tests inject faults through it)."""

    step: int
    runner: object
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict
    kv_caches: dict[str, torch.Tensor]


class GroupCanary:
    """One KV cache group: its canary, its slot table and its block mirror."""

    def __init__(self, spec: GroupSpec, kv_caches: dict[str, torch.Tensor], layout: Layout, num_blocks: int,
                 settings: AdapterSettings, rows: int, max_ctx: int):
        self.spec = spec
        self.layout = layout
        self.layer_names = spec.layer_names
        bs = spec.block_size
        self.max_blocks = -(-max_ctx // bs)
        self.max_ctx = self.max_blocks * bs
        geometry = Geometry(num_blocks, bs, spec.num_heads, spec.head_dim)
        kv = [kv_caches[name] for name in spec.layer_names]
        n = len(kv)
        layers = tuple(dict.fromkeys(i % n for i in settings.layers))
        cpu_halves = ()
        if layout is Layout.CPU:
            from kvcanary.adapters.vllm.cpu_probe import token_major_halves

            cpu_halves = token_major_halves(kv[0].dtype, bs, spec.num_heads, spec.head_dim)
        mode, halves = settings.coverage(fingerprintable(layout, cpu_halves))
        config = settings.canary_config(mode, halves, layers)
        sources = sources_for(kv, layout, geometry, layers, halves) if mode else []
        self.coverage = (mode, halves if mode else ())
        self.all_heads = covers_all_heads(layout, spec.num_heads)
        device = kv[0].device
        self.num_slots = num_blocks * bs
        window = max(spec.window - 1, 0)
        geometry = PoolGeometry(self.num_slots, rows, self.max_ctx, str(device), page_size=bs, kv_dtype=spec.dtype,
                                num_kv_heads=spec.num_heads, head_dim=spec.head_dim, model=spec.model)
        self.canary = Canary(config, geometry, sources=sources, pool=PoolKind.SWA if window else PoolKind.FULL,
                             window=window)
        # the page table the canary reads, and the adapter's host mirrors (numpy: a step's host work is
        # dozens of tiny array operations, each a few µs cheaper than torch's)
        self.req_to_token = torch.zeros(rows, self.max_ctx, dtype=torch.int32, device=device)
        self.table = self.req_to_token.numpy() if device.type == "cpu" else None
        self.blocks = np.zeros((rows, self.max_blocks), dtype=np.int32)  # block ids the table was expanded from
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # each row's token ids, as sent
        self.lut = torch.arange(self.num_slots, dtype=torch.int64, device=device) if window else None
        self.offsets = np.arange(bs, dtype=np.int32)
        # the sweep runs this group was sent, by run id (the canary keeps a run's entries while it is
        # passed the same SweepRun object: a sweep over runs seen before costs no rebuild)
        self.runs: dict[str, SweepRun] = {}

    def sweep_runs(self, msg: StepMessage) -> list[SweepRun]:
        for rid in msg.sweep_dropped:
            self.runs.pop(rid, None)
        out = []
        for rid, blocks, tokens in msg.sweep:
            run = self.runs.get(rid)
            if tokens is not None or run is None or run.slots.numel() != len(blocks) * self.spec.block_size:
                if tokens is None:
                    continue  # not held here (cannot happen while the two halves agree): swept once resent
                run = self.runs[rid] = SweepRun(self.slots_of_blocks(blocks), tuple(tokens), 0)
            out.append(run)
        return out

    def slots_of_blocks(self, blocks) -> torch.Tensor:
        b = np.asarray(blocks, dtype=np.int64)
        return torch.from_numpy((b[:, None] * self.spec.block_size + self.offsets[None, :]).reshape(-1))

    def sync_rows(self, rows: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Expand the batch's block-table entries that changed since the rows' last forward.

        Entries past a request's blocks are left as they are (never read). A sliding-window group's
        null block (id 0: out of the window) maps to slot 0, which HEAD names as a bad entry."""
        bs = self.spec.block_size
        num_blocks = (seq_lens + bs - 1) // bs
        width = min(int(num_blocks.max()), self.max_blocks, block_table.shape[1])
        if width <= 0:
            return
        cur = block_table[:, :width]
        changed = (cur != self.blocks[rows, :width]) & (np.arange(width)[None, :] < num_blocks[:, None])
        i, j = np.nonzero(changed)
        if not len(i):
            return
        ids = cur[i, j].astype(np.int32)
        self.blocks[rows[i], j] = ids
        slots = ids[:, None] * bs + self.offsets[None, :]
        if self.spec.window:
            slots[ids == 0] = 0
        cols = j[:, None] * bs + self.offsets[None, :]
        if self.table is not None:
            self.table[rows[i][:, None], cols] = slots
        else:
            self.req_to_token[torch.from_numpy(rows[i][:, None]), torch.from_numpy(cols)] = \
                torch.from_numpy(slots).to(self.req_to_token.device)


class WorkerSide:
    """The adapter in one worker process (one per tensor-parallel rank)."""

    def __init__(self, settings: AdapterSettings, groups: list[GroupSpec], layout: Layout | None,
                 max_model_len: int, max_num_seqs: int):
        self.settings = settings
        self.specs = groups
        self.layout = layout
        # what a StepMessage's blocks must mean (``messages.layout_words`` per group)
        self.block_layouts = tuple(layout_words(spec.layout()) for spec in groups)
        self._layouts_seen: tuple = self.block_layouts  # the last message layout found equal (identity is enough)
        self.max_model_len = max_model_len
        self.rows = max_num_seqs + 1  # row 0 is the padding row
        self.groups: list[GroupCanary] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.message: StepMessage | None = None
        self.step = 0
        self.pending = WorkerReport()
        self.invalid_blocks: set[int] = set()
        self.violations = []  # every violation this worker reported, in order
        self.counts: Counter = Counter()  # CanaryStats increments since the last read
        self.host_seconds = 0.0  # wall time of the checked forwards outside the model (the canary's host cost)
        # per KV cache group: request id -> its block list as the scheduler handed it out
        self.request_blocks: list[dict[str, list[int]]] = [{} for _ in groups]
        # fn(point, view) at "head" (before HEAD), "model" (after HEAD, before the model), "tail" (before TAIL)
        self.hooks: list = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        self.groups = []
        for spec in self.specs:
            shape = tuple(kv_caches[spec.layer_names[0]].shape)
            layout = self.layout
            if layout is None:  # a GPU: the layout from the tensor's shape
                guess = Geometry(shape[1] if shape[0] == 2 else shape[0], spec.block_size, spec.num_heads,
                                 spec.head_dim)
                layout = detect_layout(shape, guess)
            self.groups.append(GroupCanary(spec, kv_caches, layout, num_blocks_of(shape, layout), self.settings,
                                           self.rows, self.max_model_len))
        for g in self.groups:
            mode, halves = g.coverage
            heads = "every KV head" if g.all_heads else "the first KV head"
            covered = "+".join(h.name for h in halves)
            fp = (f"fingerprints real_kv={mode.name.lower()} of {covered} ({heads}) of layers {g.canary.config.layers}"
                  if mode else "no fingerprints (this layout stores no half by token)")
            log.warning("kv-canary: protecting vLLM KV cache group %d (%s, block_size %d, %s): records of every slot, "
                        "%s; policy=%s", g.spec.index, f"window {g.spec.window}" if g.spec.window else "full attention",
                        g.spec.block_size, g.layout.value, fp, self.settings.policy.value)

    def bind(self, message: StepMessage) -> None:
        """Take the step's message; KVCanaryError before anything is taken where its block layout
        differs from this worker's (``check_layout``)."""
        self.check_layout(message)
        self.message = message

    def check_layout(self, message: StepMessage) -> None:
        """The message's blocks mean what this worker's canaries assume: per KV cache group, the
        scheduler's ``block_layout`` equals this worker's in every ``BLOCK_FIELDS`` field (else
        KVCanaryError naming the group, the fields and both sides' values)."""
        sent = message.layout
        if sent is self._layouts_seen or sent == self.block_layouts:
            self._layouts_seen = sent
            return
        n = len(self.block_layouts)
        if not isinstance(sent, tuple) or len(sent) != n or \
                any(not isinstance(w, tuple) or len(w) != len(BLOCK_FIELDS) for w in sent):
            got = f"{len(sent)} groups" if isinstance(sent, tuple) and len(sent) != n else repr(sent)[:200]
            raise KVCanaryError(f"StepMessage.layout must hold the {BLOCK_FIELDS} of every KV cache group of this "
                                f"worker ({n}), got {got}; run the same kv-canary in every process")
        for spec, theirs in zip(self.specs, sent, strict=True):
            spec.layout().check(f"StepMessage of KV cache group {spec.index}", layout_of_words(theirs), BLOCK_FIELDS)
        self._layouts_seen = sent

    def clear(self) -> None:
        self.message = None

    # --- the forward ----------------------------------------------------------------------------

    def around_forward(self, runner, forward, kwargs: dict):
        """Run ``forward(**kwargs)`` (the model) between HEAD and TAIL of every group."""
        msg = self.message
        if msg is None or not self.groups:
            return forward(**kwargs)
        from vllm.forward_context import get_forward_context

        with torch.inference_mode(False):  # the canary's tensors outlive the step: no inference tensors
            return self._checked_forward(runner, forward, kwargs, msg, get_forward_context().attn_metadata)

    def _checked_forward(self, runner, forward, kwargs: dict, msg: StepMessage, attn: dict):
        start = time.perf_counter()
        self.step = msg.step
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        view = StepView(msg.step, runner, req_ids, kwargs["input_ids"], kwargs["positions"], attn, self.kv_caches)
        self._before_head(msg)
        for hook in self.hooks:
            hook("head", view)
        waves = [self._waves(g, view, msg) for g in self.groups]
        for g, batches in zip(self.groups, waves, strict=True):
            for b in batches:
                g.canary.head(b)
        for hook in self.hooks:
            hook("model", view)
        model_start = time.perf_counter()
        with torch.inference_mode():
            out = forward(**kwargs)
        model_seconds = time.perf_counter() - model_start
        for hook in self.hooks:
            hook("tail", view)
        for g, batches in zip(self.groups, waves, strict=True):
            for b in batches:
                g.canary.tail(b)
        self._after(msg, waves)
        self.host_seconds += time.perf_counter() - start - model_seconds
        return out

    def _before_head(self, msg: StepMessage) -> None:
        for rid in msg.gone:
            for lists in self.request_blocks:
                lists.pop(rid, None)
        for rid, (whole, per_group) in msg.blocks.items():
            for lists, ids in zip(self.request_blocks, per_group, strict=False):
                if whole or rid not in lists:
                    lists[rid] = list(ids)
                else:
                    lists[rid].extend(ids)
        for g in self.groups:
            fresh = msg.fresh_blocks[g.spec.index] if g.spec.index < len(msg.fresh_blocks) else ()
            if fresh:
                g.canary.slots_freed(g.slots_of_blocks(fresh))
        interval = self.settings.sweep_interval
        if interval and msg.step % interval == 0:  # every interval, runs or none (the watchdog counts sweeps)
            for g in self.groups:
                if g.spec.window:
                    continue  # sweeps cover the full-attention groups (their runs start at position 0)
                g.canary.sweep(g.sweep_runs(msg))
                self.counts["sweeps"] += 1

    def _waves(self, g: GroupCanary, view: StepView, msg: StepMessage) -> list[ForwardBatch]:
        """The forward as the canary sees it: one batch, or, where a request new this step hits
        prefix-cache blocks another request of this forward writes (vLLM caches a block when it hands
        it out for writing), one batch per wave: a wave's HEAD reads only slots that earlier waves'
        HEADs stamped, and its TAIL runs after theirs recorded the fingerprints."""
        md = view.attn_metadata[g.layer_names[0]]
        n = len(view.req_ids)
        qsl = _host(md.query_start_loc)[: n + 1].astype(np.int64)
        seq = _host(md.seq_lens)[:n].astype(np.int64)
        extend = qsl[1:] - qsl[:-1]
        requests = [msg.requests[rid] for rid in view.req_ids]
        rows = np.fromiter((r[0] for r in requests), dtype=np.int64, count=n)
        g.sync_rows(rows, _host(md.block_table)[:n], seq)
        num_tokens = int(qsl[-1])
        parts = _Parts(rows, seq - extend, extend, qsl, md.slot_mapping[:num_tokens].to(torch.int64),
                       view.input_ids[:num_tokens].to(torch.int64), view.positions[:num_tokens].to(torch.int64))
        first = []
        for r, (row, start, tokens) in enumerate(requests):
            history = g.tokens[row]
            del history[start:]
            history.extend(tokens)
            if start == 0:
                first.append(r)
        # only a request's first forward (truth from 0) can hit blocks written in the same forward
        waiting = [r for r in first if parts.prefix[r] > 0 and self._reads_writes_of(g, parts, r, range(n))]
        if not waiting:
            return [self._batch(g, view, msg, parts, None)]
        waves = [[r for r in range(n) if r not in waiting]]
        while waiting:
            wave = [r for r in waiting if not self._reads_writes_of(g, parts, r, waiting)]
            wave = wave or list(waiting)  # they read each other's writes: one wave, whose HEAD reports it
            waves.append(wave)
            waiting = [r for r in waiting if r not in wave]
        return [self._batch(g, view, msg, parts, idx) for idx in waves if idx]

    @staticmethod
    def _reads_writes_of(g: GroupCanary, parts: _Parts, reader: int, writers) -> bool:
        """Whether request ``reader`` reads a slot one of ``writers`` (not itself) writes this forward."""
        written = [parts.slots[int(parts.qsl[w]): int(parts.qsl[w + 1])] for w in writers if w != reader]
        if not written:
            return False
        prefix = g.req_to_token[int(parts.rows[reader]), : int(parts.prefix[reader])].to(torch.int64)
        return bool(torch.isin(prefix, torch.cat(written)).any())

    def _batch(self, g: GroupCanary, view: StepView, msg: StepMessage, parts: _Parts,
               idx: list[int] | None) -> ForwardBatch:
        """The ForwardBatch of the requests ``idx`` (None: every request, in vLLM's batch order)."""
        rows, prefix, extend = parts.rows, parts.prefix, parts.extend
        input_ids, positions, slots, req_ids = parts.input_ids, parts.positions, parts.slots, view.req_ids
        if idx is not None:
            take = torch.from_numpy(np.concatenate([np.arange(parts.qsl[r], parts.qsl[r + 1]) for r in idx]))
            input_ids, positions, slots = input_ids[take], positions[take], slots[take]
            rows, prefix, extend = rows[idx], prefix[idx], extend[idx]
            req_ids = [req_ids[r] for r in idx]
        starts, truth, offsets = [], [], [0]
        for rid in req_ids:
            _, start, tokens = msg.requests[rid]
            starts.append(start)
            truth.extend(tokens)
            offsets.append(len(truth))
        i64 = torch.int64
        return ForwardBatch(
            req_pool_indices=torch.from_numpy(rows), prefix_lens=torch.from_numpy(prefix),
            extend_lens=torch.from_numpy(extend), req_to_token=g.req_to_token, input_ids=input_ids,
            positions=positions, out_cache_loc=slots, truth_ids=torch.tensor(truth, dtype=i64),
            truth_offsets=torch.tensor(offsets, dtype=i64), truth_starts=torch.tensor(starts, dtype=i64),
            request_ids=tuple(req_ids), slot_lut=g.lut)

    # --- after the forward ----------------------------------------------------------------------

    def _after(self, msg: StepMessage, waves: list[list[ForwardBatch]]) -> None:
        """Read each group's report: the damaged blocks leave the prefix cache (the scheduler's half
        evicts them), and under raise/recompute the blocks through which the requests that read
        the damage are failed or rewound go to vLLM (``_recovery_blocks``)."""
        self.counts["forwards"] += 1
        for g, batches in zip(self.groups, waves, strict=True):
            rep = g.canary.end_step(msg.step)
            if not rep.violations:
                continue
            self.violations.extend(rep.violations)
            self.counts["incidents"] += len(rep.incidents)
            for v in rep.violations:
                reasons = "+".join(Reason.names(v.reasons)).lower()
                self.counts[CanaryStats.violation_key(reasons, v.tag.point.name)] += 1
            bs = g.spec.block_size
            damaged = {v.slot // bs for v in rep.violations if 0 < v.slot < g.num_slots} - {0}
            readers = {r for v in rep.violations for r, _ in self._readers(g, v, msg)}
            if damaged:
                self.pending.damaged.setdefault(g.spec.index, set()).update(damaged)
            self.pending.readers |= set(readers)
            if rep.recovery is not None:
                blocks = self._recovery_blocks(g, batches, rep.violations, msg)
                self.invalid_blocks |= blocks
                self.counts["recovered_requests"] += len(readers)

    def _readers(self, g: GroupCanary, v, msg: StepMessage) -> list[tuple[str, int]]:
        """The requests of this forward whose own read failed in violation ``v``. The canary names
        every request that reads the slot; a request whose token and position at that position are
        the ones the slot holds did not fail a token or position check (another reader did: a
        wrong page-table entry points it at this slot), unless the slot's bytes are damaged."""
        identity = Reason.VERIFY_TOKEN | Reason.POSITION
        out = []
        for rid, position in v.owners:
            if not isinstance(rid, str) or rid not in msg.requests:
                continue  # a sweep's "cache", or a request not in this forward
            if v.reasons & identity and not v.reasons & ~(identity | Reason.CHAIN):
                history = g.tokens[msg.requests[rid][0]]
                same_token = position < len(history) and history[position] == v.token
                if same_token and position == v.position:
                    continue
            out.append((rid, position))
        return out

    def _recovery_blocks(self, g: GroupCanary, batches: list[ForwardBatch], violations,
                         msg: StepMessage) -> set[int]:
        """The blocks that make vLLM fail or rewind exactly the requests that read the damage.

        vLLM finds the requests a bad block affects through its own block lists, so each reader of
        a violation is named by the block its own list holds at the position it read (not the
        slot's block: a wrong page-table entry reads another request's block). A position past the
        tokens the request had computed before this forward (a write of this forward) is named by
        the block of its last computed token, so that vLLM rewinds it and drops this forward's token;
        a request's first forward has none (docs/vllm.md)."""
        bs = g.spec.block_size
        lists = self.request_blocks[g.spec.index]
        computed = {rid: int(b.prefix_lens[r]) for b in batches for r, rid in enumerate(b.request_ids)}
        out = set()
        for v in violations:
            for rid, position in self._readers(g, v, msg):
                blocks, c = lists.get(rid), computed.get(rid)
                if blocks is None or c is None:
                    continue  # not a request of this forward (a sweep's "cache")
                index = position // bs
                if index >= -(-c // bs):
                    if c == 0:
                        continue
                    index = (c - 1) // bs
                if index < len(blocks) and blocks[index] > 0:
                    out.add(blocks[index])
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def take_report(self) -> WorkerReport | None:
        report, self.pending = self.pending, WorkerReport()
        return None if report.is_empty() else report

    def take_stats(self) -> CanaryStats | None:
        """Counter increments since the last call (vLLM ships them to its Prometheus metrics)."""
        if not self.counts:
            return None
        stats, self.counts = CanaryStats(data=dict(self.counts)), Counter()
        return stats


@dataclass(frozen=True)
class _Parts:
    """A forward's per-request arrays (host) and per-token tensors, in vLLM's batch order."""

    rows: np.ndarray
    prefix: np.ndarray
    extend: np.ndarray
    qsl: np.ndarray
    slots: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor


def _host(t: torch.Tensor) -> np.ndarray:
    """A host view of a small per-request tensor (a copy where it lives on a device)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()
