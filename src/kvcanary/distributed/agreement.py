"""``RankAgreement``: tensor-parallel ranks that agree on what their canaries saw, and act together.

Every rank keeps its own pool, page table and ``Canary`` (or several: a full and a sliding-window
pool), and runs the same schedule. The agreement wraps the rank's canaries:

    agreement = RankAgreement(canary, Policy.RECOMPUTE, group)   # canary built with Policy.LOG
    canary.head(batch); agreement.launch(step, batch)            # after HEAD, before the forward
    model(batch); canary.tail(batch)
    report = agreement.end_step(step)                            # instead of canary.end_step
    ...
    report = agreement.finish(step)                              # instead of canary.flush

``launch`` = ``prepare`` + ``issue`` + ``launched``. ``issue`` is the device half: one
``signal_row`` kernel (per ring) writes this rank's row of a static ``int64[world, 4]`` table
(violation rows since the last signal, their reasons and launch points, the watchdog flag, the
chain digest of the batch just stamped, the step; ``kvcanary.ops.signal``) and the table is
all-reduced, with no host read and no allocation, so it can be captured in a CUDA graph together
with HEAD and the forward (NCCL; on a side stream that ``join`` merges back before the capture
ends). gloo cannot be captured: on the CPU the same calls run eagerly and the all-reduce is
asynchronous. ``launched`` is the host half after the device half was enqueued (or a graph
replayed it): the table's copy to pinned host memory (CUDA) and the bookkeeping.

``end_step`` runs the canaries' own ``end_step`` (their reporters may reset ring counters: the
rows before a reset are settled into ``SignalBuffers.pending`` first, on the device) and reads
the agreed table ``lag`` steps late: ``lag = 1`` under log and raise (the table of step s is read
at the end of step s + 1, long complete: nothing waits), ``lag = 0`` under recompute, where the
table of the step is joined before sampling so no token of a damaged step is sampled. A
violation found at HEAD is in the step's own table, one found at TAIL or SWEEP in the next one.

The policy is applied here, on the agreed table, so every rank acts at the same step whatever it
saw itself (the wrapped canary must run ``Policy.LOG``): ``raise`` raises ``CanaryViolation`` on
every rank; ``recompute`` exchanges the ranks' recovery sets (``all_gather_object``: only in a
step that has to act) and hands every rank their union, so all ranks retract the same requests
and quarantine the same slots and their allocators stay equal. A watchdog alarm on any rank raises
``WatchdogTimeout`` on every rank under raise and recompute.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvcanary.config import Policy
from kvcanary.core.record import PoolKind
from kvcanary.distributed.divergence import Cause, RankDivergence, find_divergences
from kvcanary.distributed.signal import ALARM_BIT, CODE, ROWS, SIGNAL_WIDTH, STEP, SignalBuffers, signal_row
from kvcanary.errors import ConfigError, KVCanaryError
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, StepReport
from kvcanary.runtime.policy import Recovery, acts, decide, merge_recoveries
from kvcanary.runtime.reporting import Violation

log = logging.getLogger("kvcanary")


class RanksOutOfStep(KVCanaryError):
    """The ranks' signals of one all-reduce belong to different steps: their schedules diverged."""


@dataclass
class AgreedStepReport(StepReport):
    """The local ``StepReport`` of ``step`` plus what the ranks agreed on in this call:
    ``agreed_steps`` (steps whose tables completed), their ``divergences``; ``recovery`` is the
    union over the ranks under the recompute policy."""

    agreed_steps: list[int] = field(default_factory=list)
    tables: list[list[list[int]]] = field(default_factory=list)
    divergences: list[RankDivergence] = field(default_factory=list)


@dataclass
class _InFlight:
    step: int
    buffer: int
    work: object | None  # the gloo all-reduce (CPU); None on CUDA, where the buffer's event tells
    request_ids: tuple


SlotMap = Callable[[PoolKind, list[int]], list[int]]  # a pool's slots -> the engine's slots for recompute


class RankAgreement:
    """Wraps this rank's ``canary`` (built with ``Policy.LOG``), or several (the first one's
    records give the chain digest, e.g. a full pool, then a sliding-window pool); applies ``policy``
    in lock-step over ``group`` (None: the default process group, which must be initialised).
    ``slot_map`` turns the slots of a pool's violations into the slots the engine recomputes
    (default: unchanged). ``lag``: steps between a table's launch and its read (None: 0 under
    recompute, 1 otherwise). Every buffer is allocated here, once."""

    def __init__(self, canary: Canary | Sequence[Canary], policy: Policy, group: dist.ProcessGroup | None = None,
                 slot_map: SlotMap | None = None, lag: int | None = None):
        canaries = [canary] if isinstance(canary, Canary) else list(canary)
        for c in canaries:
            if c.config.enabled and c.config.policy is not Policy.LOG:
                raise ConfigError(f"the canary wrapped by RankAgreement must run Policy.LOG, got "
                                  f"{c.config.policy}; pass the policy to RankAgreement instead")
        lag = (0 if policy is Policy.RECOMPUTE else 1) if lag is None else lag
        if lag not in (0, 1):
            raise ConfigError(f"lag {lag!r} not in (0, 1); 0 joins the table before sampling, 1 reads it a step late")
        if policy is Policy.RECOMPUTE and lag != 0:
            raise ConfigError("lag 1 under Policy.RECOMPUTE would sample tokens of a damaged step; use lag 0")
        canary = canaries[0]
        if not dist.is_initialized():
            raise ConfigError("RankAgreement needs torch.distributed initialised; call "
                              "torch.distributed.init_process_group first")
        self.canaries, self.canary, self.policy, self.group = canaries, canary, policy, group
        self.slot_map = slot_map or (lambda pool, slots: slots)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        dev = canary.state.device
        self.is_cuda, self.lag = dev.type == "cuda", lag
        self.states = [c.state for c in canaries]
        self.buffers = SignalBuffers.allocate(len(canaries), dev)
        for k, s in enumerate(self.states):
            self.buffers.marks[k:k + 1].copy_(s.ring_counter)
        # CUDA: one static table (a graph's), copied into lag + 1 pinned buffers behind the all-reduce;
        # CPU: lag + 1 tables, one per all-reduce in flight
        self._tables = [torch.zeros(self.world, SIGNAL_WIDTH, dtype=torch.int64, device=dev)
                        for _ in range(1 if self.is_cuda else lag + 1)]
        self._hosts = [torch.zeros(self.world, SIGNAL_WIDTH, dtype=torch.int64, pin_memory=True)
                       for _ in range(lag + 1)] if self.is_cuda else []
        self._events = [torch.cuda.Event() for _ in range(lag + 1)] if self.is_cuda else []
        self._side = torch.cuda.Stream(device=dev) if self.is_cuda else None
        self._device_step: int | None = None  # the step the next issue writes (buffers.step)
        self._side_copy = False  # an eager launch's table copy is on the side stream
        self._work = None
        self._in_flight: deque[_InFlight] = deque()
        self._launches = 0
        self._unacted: list[Violation] = []  # local violations no policy action has covered yet
        self.divergences: list[RankDivergence] = []
        self.seconds = 0.0  # host time inside the agreement (launch, settle, completion, policy)

    @property
    def enabled(self) -> bool:
        return self.canary.config.enabled

    # --- per step ------------------------------------------------------------------------------

    def launch(self, step: int, batch: ForwardBatch | None) -> None:
        """After HEAD of ``step``, eagerly: ``prepare``, ``issue``, ``launched``. ``batch`` None
        (end of run) digests to 0. Never blocks."""
        self.prepare(step)
        self.issue(batch)
        self.launched(step, batch)

    def prepare(self, step: int) -> None:
        """Before the device half of ``step`` (outside any capture): set the step the signal
        carries when it is not the one after the last (a write only then); on CUDA, order the
        table's rewrite after the copy an eager launch left on the side stream."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        if self._side_copy:
            torch.cuda.current_stream().wait_stream(self._side)
            self._side_copy = False
        if step != self._device_step:
            self.buffers.step.fill_(step)
            self._device_step = step
        self.seconds += time.perf_counter() - t0

    def issue(self, batch: ForwardBatch | None) -> None:
        """The device half, capturable: the signal row kernel(s) and the all-reduce of the static
        table. Inside a CUDA-graph capture call ``join`` before the capture ends; replaying the
        graph issues it; call ``launched`` after each replay."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        table = self._tables[self._launches % len(self._tables)]
        tensors = {} if batch is None else dict(req_pool_indices=batch.req_pool_indices,
                                                 extend_lens=batch.extend_lens, out_cache_loc=batch.out_cache_loc)
        signal_row(states=self.states, buffers=self.buffers, table=table, rank=self.rank, **tensors)
        if self.is_cuda:
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):  # the forward does not wait for the signal's all-reduce
                dist.all_reduce(table, group=self.group)
        else:
            self._work = dist.all_reduce(table, group=self.group, async_op=True)
        self.seconds += time.perf_counter() - t0

    def join(self) -> None:
        """Inside a CUDA-graph capture, after the forward: the side stream joins the capture."""
        if self.is_cuda and self.enabled:
            torch.cuda.current_stream().wait_stream(self._side)

    def launched(self, step: int, batch: ForwardBatch | None, replayed: bool = False) -> None:
        """The host half of ``step``'s signal, after ``issue`` (or, ``replayed``, a graph
        replay) enqueued it: the table's copy to pinned memory behind the all-reduce (CUDA: on
        the side stream after an eager issue, behind the graph after a replay), the bookkeeping."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        k = self._launches % (self.lag + 1)
        work, self._work = self._work, None
        if self.is_cuda:
            stream = torch.cuda.current_stream() if replayed else self._side
            with torch.cuda.stream(stream):
                self._hosts[k].copy_(self._tables[0], non_blocking=True)
                self._events[k].record(stream)
            self._side_copy = not replayed  # the next prepare orders the table's rewrite after it
        request_ids = tuple(r for r in (batch.request_ids or ()) if r is not None) if batch is not None else ()
        self._in_flight.append(_InFlight(step, k, work, request_ids))
        self._launches += 1
        self._device_step = step + 1
        self.seconds += time.perf_counter() - t0

    def end_step(self, step: int) -> AgreedStepReport:
        """The canaries' ``end_step`` (their violations and alarms, merged), then the tables
        launched at least ``lag`` steps ago and the policy on them. Raises ``CanaryViolation``
        (raise) or ``WatchdogTimeout`` on every rank together; ``RanksOutOfStep`` if the ranks'
        steps differ."""
        if not self.enabled:
            return self._merge(step, [c.end_step(step) for c in self.canaries])
        report = self._around_reporters(lambda: [c.end_step(step) for c in self.canaries], step)
        return self._agree(report, self.lag)

    def finish(self, step: int) -> AgreedStepReport:
        """End of run: flush the canaries, signal what is left, complete every all-reduce and apply
        the policy. Call on every rank after the last step."""
        if not self.enabled:
            return self._merge(step, [c.flush(step) for c in self.canaries])
        report = self._around_reporters(lambda: [c.flush(step) for c in self.canaries], step)
        self.launch(step, None)
        return self._agree(report, 0)

    def drain(self) -> None:
        """Wait for every all-reduce in flight without acting on it (after an error stopped the run)."""
        while self._in_flight:
            flight = self._in_flight.popleft()
            if flight.work is not None:
                flight.work.wait()
            elif self.is_cuda:
                self._events[flight.buffer].synchronize()

    # --- internals -----------------------------------------------------------------------------

    def _around_reporters(self, run: Callable[[], list[StepReport]], step: int) -> AgreedStepReport:
        t0 = time.perf_counter()
        signal_row(states=self.states, buffers=self.buffers)  # settle: a reporter may reset a counter next
        self.seconds += time.perf_counter() - t0
        report = self._merge(step, run())
        t0 = time.perf_counter()
        for k, s in enumerate(self.states):
            self.buffers.marks[k:k + 1].copy_(s.ring_counter)  # count from the (possibly reset) counter on
        if report.alarms:
            self.buffers.alarm.fill_(1)  # signalled with the next launch
        self.seconds += time.perf_counter() - t0
        return report

    @staticmethod
    def _merge(step: int, reports: list[StepReport]) -> AgreedStepReport:
        violations = [v for r in reports for v in r.violations]
        return AgreedStepReport(step, violations, [a for r in reports for a in r.alarms])

    def _agree(self, report: AgreedStepReport, keep: int) -> AgreedStepReport:
        t0 = time.perf_counter()
        self._unacted += report.violations
        try:
            while len(self._in_flight) > keep:
                self._complete(self._in_flight.popleft(), report)
        finally:
            self.seconds += time.perf_counter() - t0
        return report

    def _complete(self, flight: _InFlight, report: AgreedStepReport) -> None:
        if flight.work is not None:
            flight.work.wait()
            table = self._tables[flight.buffer % len(self._tables)].tolist()
        else:
            self._events[flight.buffer].synchronize()  # lag 1: launched a step ago, complete already
            table = self._hosts[flight.buffer].tolist()
        steps = [row[STEP] for row in table]
        if any(s != flight.step for s in steps):
            raise RanksOutOfStep(f"rank {self.rank} agreed on step {flight.step} but the ranks sent steps {steps}; "
                                 "their schedules diverged")
        divergences = find_divergences(flight.step, table, self.rank)
        for d in divergences:
            log.warning(d.line())
        self.divergences += divergences
        report.agreed_steps.append(flight.step)
        report.tables.append(table)
        report.divergences += divergences
        self._apply_policy(flight, table, divergences, report)

    def _apply_policy(self, flight: _InFlight, table: list[list[int]], divergences: list[RankDivergence],
                      report: AgreedStepReport) -> None:
        if not acts(self.policy):
            self._unacted = []  # log: nothing to act on, nothing to keep
            return
        alarmed = [r for r, row in enumerate(table) if row[CODE] & ALARM_BIT]
        reporting = [r for r, row in enumerate(table) if row[ROWS] > 0]
        damage = None
        if reporting or divergences:
            where = "; ".join(d.line() for d in divergences) or f"ranks {reporting} reported violations"
            first = f"; first here: {self._unacted[0].line()}" if self._unacted else ""
            damage = f"step {flight.step}, rank {self.rank} of {self.world}: {where}{first}"
        alarm = f"step {flight.step}: the canary watchdog fired on rank(s) {alarmed}" if alarmed else None
        recovery = decide(self.policy, alarm=alarm, damage=damage, violations=list(self._unacted),
                          recovery=lambda: self._exchange_recovery(flight, divergences))
        if recovery is not None:
            report.recovery = recovery

    def _exchange_recovery(self, flight: _InFlight, divergences: list[RankDivergence]) -> Recovery:
        """The union of every rank's recovery set. A chain-digest divergence that no rank's checks
        explain names no request: then every request of the step's batch is recomputed, dropping
        outputs from the step before (the diverging token may have been sampled there)."""
        vs, self._unacted = self._unacted, []
        requests = list(dict.fromkeys(r for v in vs for r in v.requests))
        by_pool = {pool: sorted({v.slot for v in vs if v.slot > 0 and v.tag.pool is pool}) for pool in PoolKind}
        slots = sorted({s for pool, ss in by_pool.items() if ss for s in self.slot_map(pool, ss)})
        since = min((v.step for v in vs), default=flight.step)
        if any(d.cause is Cause.CHAIN_DIGEST for d in divergences):
            requests += [r for r in flight.request_ids if r not in requests]
            since = min(since, flight.step - 1)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (requests, slots, since), group=self.group)
        every = [Recovery(tuple(dict.fromkeys(reqs)), tuple(sorted(set(ss))), s) for reqs, ss, s in gathered]
        return merge_recoveries(*every)
