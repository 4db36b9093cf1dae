"""One Canary attached to one transformers ``ContinuousBatchProcessor``: the per-forward hooks.

Every hook wraps a method on the *instance* (never the class) and is undone by ``detach``:

| wrapped call                                   | canary action                                         |
|------------------------------------------------|-------------------------------------------------------|
| ``processor.prepare_next_batch``               | step hooks (fault injection), SWEEP of idle cached    |
|                                                | blocks (when due), then collect the batch             |
| ``cache.extend_read_and_write_indices``,       | record each request's slots (what attention reads),   |
| ``cache.fill_block_table``                     | tokens, prefix and extend lengths                     |
| ``processor._generation_step``                 | HEAD, the forward, TAIL, end_step                     |
| ``offloading_manager._offload_to_cpu``         | export the offloaded requests' canary rows            |
| ``offloading_manager.restore_scheduled_requests`` | import them into the new slots, verified at once   |
| ``processor.reset``                            | forget the per-request bookkeeping                    |

Each forward becomes a ``ForwardBatch`` whose page table is rebuilt from the read indices
transformers computed for it, so a wrong block table is seen exactly as attention sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kvcanary.adapters._hf_layout import CacheLayout, layout_for
from kvcanary.config import CanaryConfig
from kvcanary.errors import CapacityError, ConfigError, KVCanaryError
from kvcanary.ops.fingerprint import KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry, StepReport
from kvcanary.runtime.sweep import SweepRun


@dataclass
class _Entry:
    """One request of the forward being prepared."""

    request_id: str
    prefix_len: int
    extend_len: int
    slots: list[int]  # slot of each position in [0, prefix_len + extend_len)
    input_ids: list[int]
    truth: list[int]  # prompt + generated tokens so far


@dataclass(frozen=True)
class _BlockInfo:
    """What the canary stamped into a block: needed to sweep it once only the prefix cache holds it."""

    start_position: int
    token_ids: tuple[int, ...]
    parent: int  # first slot of the block before it, -1 at a sequence head
    parent_version: int
    version: int


@dataclass
class AdapterStats:
    """Engine-side counts the adapter observed (they prove the paths were exercised)."""

    forwards: int = 0
    requests: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from shared blocks
    offloaded_requests: int = 0  # requests whose K/V went to the CPU swap pool with their canary rows
    offloaded_slots: int = 0
    restored_requests: int = 0
    restored_slots: int = 0
    swept_slots: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


StepHook = Callable[["Attachment", int], None]


@dataclass
class Attachment:
    processor: object
    config: CanaryConfig
    max_ctx: int
    step_hooks: list[StepHook]
    reports: list[StepReport] = field(default_factory=list)
    stats: AdapterStats = field(default_factory=AdapterStats)
    step: int = 0
    error: str | None = None  # why the raise policy (or the watchdog) stopped generation

    def __post_init__(self):
        p = self.processor
        if getattr(p, "use_async_batching", False):
            raise ConfigError("the transformers adapter needs synchronous batching (the next batch is prepared while "
                              "the previous forward runs otherwise); pass ContinuousBatchingConfig("
                              "use_async_batching=False)")
        self.cache = p.cache
        self.layout: CacheLayout = layout_for(self.cache)
        device = torch.device(self.cache.device)
        rows = self.config.max_bs + 1
        geometry = PoolGeometry(self.layout.num_slots, rows, self.max_ctx, str(device))
        self.canary = Canary(self.config, geometry, sources=self._sources(p.config.num_hidden_layers))
        self.table = torch.zeros(rows, self.max_ctx, dtype=torch.int32, device=device)
        self._wrapped: list[tuple[object, str, object]] = []
        self._collecting = False
        self._entries: list[_Entry] = []
        self._batch: ForwardBatch | None = None
        self._held: dict[str, torch.Tensor] = {}  # request id -> canary rows of its offloaded K/V
        self._seen: set[str] = set()
        self._blocks: dict[int, _BlockInfo] = {}
        self._version = 0
        self._extend = self.cache.extend_read_and_write_indices
        self._wrap(p, "prepare_next_batch", self._prepare_next_batch)
        self._wrap(p, "_generation_step", self._generation_step)
        self._wrap(p, "reset", self._reset)
        self._wrap(self.cache, "extend_read_and_write_indices", self._extend_indices)
        self._wrap(self.cache, "fill_block_table", self._fill_block_table)
        self._wrap(p.offloading_manager, "_offload_to_cpu", self._offload_to_cpu)
        self._wrap(p.offloading_manager, "restore_scheduled_requests", self._restore)

    def _sources(self, num_layers: int) -> list[KVSource]:
        layers = self.config.layers if self.config.layers is not None else tuple(dict.fromkeys((0, num_layers - 1)))
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise ConfigError(f"CanaryConfig.layers has {layer}, outside the model's [0, {num_layers}) layers")
        return [KVSource.from_buffer(self.layout.kv_views(layer)[h.value], half=h, layer=layer)
                for layer in layers for h in self.config.halves]

    # --- wrapping ----------------------------------------------------------------------------

    def _wrap(self, obj, name: str, make) -> None:
        previous = obj.__dict__.get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name, previous))

    def detach(self) -> None:
        """Undo every wrap (the instances get their own methods back)."""
        for obj, name, previous in reversed(self._wrapped):
            if previous is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, previous)
        self._wrapped.clear()

    def _stream(self):
        s = getattr(self.processor.inputs_and_outputs, "compute_stream", None)
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    # --- collecting the batch ----------------------------------------------------------------

    def _prepare_next_batch(self, orig):
        def prepare_next_batch():
            self.layout.before_step()
            self._prune()
            for hook in self.step_hooks:
                hook(self, self.step)
            if self.canary.sweep_due(self.step):  # before the scheduler may evict or re-share cached blocks
                with self._stream():
                    self._sweep()
            self._collecting, self._entries = True, []
            try:
                ready = orig()
            finally:
                self._collecting = False
            try:
                self._batch = self._build_batch(self._entries) if ready and self._entries else None
            except KVCanaryError as e:  # a capacity chosen at install is too small: transformers fails the batch
                self.error = str(e)
                raise
            return ready
        return prepare_next_batch

    def slots_of(self, request_id: str, length: int) -> list[int]:
        """Slots of positions [0, length) of a request, from its live block table."""
        write = [[]]  # one allocator: full attention only
        self._extend(request_id, 0, length, None, write)
        return write[0]

    def _extend_indices(self, orig):
        def extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index):
            r0 = len(read_index[0]) if read_index is not None else 0
            w0 = len(write_index[0])
            orig(request_id, past_length, query_length, read_index, write_index)
            if self._collecting:
                n = past_length + query_length
                if read_index is not None and len(read_index[0]) - r0 == n:
                    slots = read_index[0][r0:]
                elif past_length == 0:
                    slots = write_index[0][w0:]
                else:
                    slots = self.slots_of(request_id, n)
                self._record(request_id, past_length, query_length, slots)
        return extend_read_and_write_indices

    def _fill_block_table(self, orig):
        def fill_block_table(request_id, past_length, query_length, block_table):
            orig(request_id, past_length, query_length, block_table)
            if self._collecting:
                self._record(request_id, past_length, query_length,
                             self.slots_of(request_id, past_length + query_length))
        return fill_block_table

    def _record(self, request_id: str, past: int, query: int, slots: list[int]) -> None:
        state = self.processor.scheduler.active_requests.get(request_id)
        if state is None:
            return
        if request_id not in self._seen:
            self._seen.add(request_id)
            self.stats.requests += 1
            self.stats.prefix_hit_tokens += past
        truth = list(state.initial_tokens) + list(state.generated_tokens)
        self._entries.append(_Entry(request_id, past, query, list(slots), list(state.tokens_to_process)[:query], truth))

    def _build_batch(self, entries: list[_Entry]) -> ForwardBatch:
        bs = len(entries)
        if bs > self.config.max_bs:
            raise CapacityError(f"forward of {bs} requests > CanaryConfig.max_bs ({self.config.max_bs}); raise max_bs")
        lens = [e.prefix_len + e.extend_len for e in entries]
        longest = max(lens)
        if longest > self.max_ctx:
            raise CapacityError(f"a request reaches {longest} tokens > the adapter's max_ctx ({self.max_ctx}); "
                                "pass a larger max_ctx to install()")
        host = torch.zeros(bs, longest, dtype=torch.int32)
        for i, e in enumerate(entries):
            host[i, : lens[i]] = torch.tensor(e.slots, dtype=torch.int32)
        dev = self.table.device
        self.table[1: bs + 1, :longest].copy_(host.to(dev))
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)
        truth_lens = [len(e.truth) for e in entries]
        return ForwardBatch(
            req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64, device=dev),
            prefix_lens=i64([e.prefix_len for e in entries]), extend_lens=i64([e.extend_len for e in entries]),
            req_to_token=self.table, input_ids=i64([t for e in entries for t in e.input_ids]),
            positions=i64([p for e in entries for p in range(e.prefix_len, e.prefix_len + e.extend_len)]),
            out_cache_loc=i64([s for e in entries for s in e.slots[e.prefix_len:]]),
            truth_ids=i64([t for e in entries for t in e.truth]),
            truth_offsets=i64([0, *accumulate(truth_lens)]),
            request_ids=tuple(e.request_id for e in entries))

    # --- the forward ---------------------------------------------------------------------------

    def _generation_step(self, orig):
        def generation_step(model):
            batch, entries = self._batch, self._entries
            if batch is None:
                return orig(model)
            canary = self.canary
            with self._stream():
                canary.head(batch)
                orig(model)
                canary.tail(batch)
                self._remember(entries)
                self.stats.forwards += 1
                self.step += 1
                try:
                    report = canary.end_step(self.step - 1)
                except KVCanaryError as e:  # raise policy: transformers fails the running requests
                    self.error = str(e)
                    self.reports.append(StepReport(self.step - 1, list(getattr(e, "violations", []))))
                    raise
            if report.violations or report.alarms:
                self.reports.append(report)
        return generation_step

    def _remember(self, entries: list[_Entry]) -> None:
        for e in entries:
            self._note_blocks(e.slots, e.truth, e.prefix_len, e.prefix_len + e.extend_len)

    def _note_blocks(self, slots: list[int], truth: list[int], start: int, end: int) -> None:
        """Keep what was stamped into the blocks holding positions [start, end) (to sweep them once only
        the prefix cache holds them); ``slots`` and ``truth`` cover positions [0, end)."""
        page = self.layout.page_size
        for k in range(start // page, (end - 1) // page + 1):
            first = slots[k * page]
            parent = slots[(k - 1) * page] if k else -1
            known = self._blocks.get(parent)
            self._version += 1
            self._blocks[first] = _BlockInfo(k * page, tuple(truth[k * page: min(end, (k + 1) * page)]), parent,
                                             known.version if known else -1, self._version)

    def _sweep(self) -> None:
        page, runs = self.layout.page_size, []
        for block in self.layout.cached_blocks():
            slots = self.layout.block_slots(block)
            info = self._blocks.get(slots[0])
            if info is None:
                continue
            parent = self._blocks.get(info.parent)
            linked = (parent is not None and parent.version == info.parent_version
                      and self.layout.is_hashed(self.layout.block_of_slot(info.parent)))
            n = len(info.token_ids)
            runs.append(SweepRun(torch.tensor(slots[:n], dtype=torch.int64), info.token_ids, info.start_position,
                                 info.parent + page - 1 if linked else -1))
        self.stats.swept_slots += self.canary.sweep(runs)

    # --- offload and restore --------------------------------------------------------------------

    def _offload_to_cpu(self, orig):
        def offload_to_cpu(victims, *args, **kwargs):
            # transformers 5.24 frees the victims' blocks first and passes their tables; 5.17 passes none
            tables = args[0] if args and isinstance(args[0], dict) else kwargs.get("victim_block_tables")
            rows = {}
            with self._stream():
                for state in victims:
                    rid, n = state.request_id, state.position_offset
                    blocks = next(iter(tables[rid].values()), []) if tables else self.layout.block_table(rid)
                    if blocks and n > 0:
                        rows[rid] = self.canary.export_rows(torch.tensor(self.layout.slots_of(blocks, n)))
            done = orig(victims, *args, **kwargs)
            for request_id in done:
                if request_id in rows:
                    self._held[request_id] = rows[request_id]
                    self.stats.offloaded_requests += 1
                    self.stats.offloaded_slots += rows[request_id].shape[0]
            return done
        return offload_to_cpu

    def _restore(self, orig):
        def restore_scheduled_requests(requests_in_batch, *args, **kwargs):
            back = [f.state for f in requests_in_batch
                    if getattr(f.state, "is_cpu_offloaded", False) and f.state.request_id in self._held]
            out = orig(requests_in_batch, *args, **kwargs)
            with self._stream():
                for state in back:
                    rows = self._held.pop(state.request_id)
                    n = min(rows.shape[0], state.position_offset)
                    slots = self.slots_of(state.request_id, n)
                    self.canary.import_rows(torch.tensor(slots, dtype=torch.int64), rows[:n], self.canary.signature)
                    if n:
                        self._note_blocks(slots, list(state.initial_tokens) + list(state.generated_tokens), 0, n)
                    self.stats.restored_requests += 1
                    self.stats.restored_slots += n
            return out
        return restore_scheduled_requests

    # --- bookkeeping -----------------------------------------------------------------------------

    def _prune(self) -> None:
        sched = self.processor.scheduler
        live = sched.active_requests.keys() | sched.waiting_requests.keys()
        for request_id in [r for r in self._held if r not in live]:
            del self._held[request_id]
        self._seen &= live

    def _reset(self, orig):
        def reset():
            orig()
            self._held.clear()
            self._blocks.clear()
            self._batch = None
        return reset

    def flush(self) -> StepReport:
        with self._stream():
            report = self.canary.flush(self.step)
        if report.violations:
            self.reports.append(report)
        return report
