"""``RankAgreement``: tensor-parallel ranks that agree on what their canaries saw, and act together.

Every rank keeps its own pool, page table and ``Canary`` (or several: a full and a sliding-window
pool), and runs the same schedule. The agreement wraps the rank's canaries:

    agreement = RankAgreement(canary, Policy.RECOMPUTE, group)   # canary built with Policy.LOG
    canary.head(batch); agreement.launch(step, batch)            # after HEAD, before the forward
    model(batch); canary.tail(batch)
    report = agreement.end_step(step)                            # instead of canary.end_step
    ...
    report = agreement.finish(step)                              # instead of canary.flush

``launch`` writes this rank's signal row (``signal.py``: violation rows since the last launch,
their reasons and launch points, the chain digest of the batch just stamped, the step) on the
device and starts an asynchronous all-reduce of the table; nothing waits for it. ``end_step``
runs the canary's own ``end_step`` and completes the all-reduce launched ``lag`` steps earlier
(0 on the CPU, where the forward's own collectives have already passed it; 1 on CUDA, read from
pinned memory like the reporter's snapshots), so a violation found at HEAD on any rank is known to
every rank in the same step (CPU) or the next (CUDA), and one found at TAIL one step later.

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
from kvcanary.distributed.signal import ALARM_BIT, CODE, DIGEST, ROWS, SIGNAL_WIDTH, STEP, RingSummary, chain_digest
from kvcanary.errors import CanaryViolation, ConfigError, KVCanaryError
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, Recovery, StepReport, WatchdogTimeout
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


class _RingWatch:
    """The rows one canary appended to its ring since the last signal (device tensors)."""

    def __init__(self, canary: Canary):
        self.canary = canary
        self.summary = RingSummary(canary.state.ring)
        self.mark = canary.state.ring_counter.clone()  # counter value up to which rows were signalled
        self.carry_rows = torch.zeros_like(self.mark)  # rows settled before a reporter reset
        self.carry_code = torch.zeros_like(self.mark)

    def settle(self) -> None:
        """Before the canary's ``end_step``, whose reporter may reset the ring counter."""
        rows, code = self.summary(self.mark, self.canary.state.ring_counter)
        self.carry_rows += rows
        self.carry_code |= code
        self.mark.copy_(self.canary.state.ring_counter)

    def rebase(self) -> None:
        """After the canary's ``end_step``: count from the (possibly reset) counter on."""
        self.mark.copy_(self.canary.state.ring_counter)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, code) since the last ``take``; starts over."""
        rows, code = self.summary(self.mark, self.canary.state.ring_counter)
        rows, code = rows + self.carry_rows, code | self.carry_code
        self.mark.copy_(self.canary.state.ring_counter)
        self.carry_rows.zero_()
        self.carry_code.zero_()
        return rows, code


@dataclass
class _InFlight:
    step: int
    buffer: int
    work: object
    event: object | None
    request_ids: tuple


SlotMap = Callable[[PoolKind, list[int]], list[int]]  # a pool's slots -> the engine's slots for recompute


class RankAgreement:
    """Wraps this rank's ``canary`` (built with ``Policy.LOG``), or several (the first one's
    records give the chain digest, e.g. a full pool, then a sliding-window pool); applies ``policy``
    in lock-step over ``group`` (None: the default process group, which must be initialised).
    ``slot_map`` turns the slots of a pool's violations into the slots the engine recomputes
    (default: unchanged)."""

    def __init__(self, canary: Canary | Sequence[Canary], policy: Policy, group: dist.ProcessGroup | None = None,
                 slot_map: SlotMap | None = None):
        canaries = [canary] if isinstance(canary, Canary) else list(canary)
        for c in canaries:
            if c.config.enabled and c.config.policy is not Policy.LOG:
                raise ConfigError(f"the canary wrapped by RankAgreement must run Policy.LOG, got "
                                  f"{c.config.policy}; pass the policy to RankAgreement instead")
        canary = canaries[0]
        if not dist.is_initialized():
            raise ConfigError("RankAgreement needs torch.distributed initialised; call "
                              "torch.distributed.init_process_group first")
        self.canaries, self.canary, self.policy, self.group = canaries, canary, policy, group
        self.slot_map = slot_map or (lambda pool, slots: slots)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        dev = canary.state.device
        self.is_cuda = dev.type == "cuda"
        self.lag = 1 if self.is_cuda else 0
        self._tables = [torch.zeros(self.world, SIGNAL_WIDTH, dtype=torch.int64, device=dev)
                        for _ in range(self.lag + 1)]
        self._hosts = [torch.zeros(self.world, SIGNAL_WIDTH, dtype=torch.int64, pin_memory=self.is_cuda)
                       for _ in range(self.lag + 1)]
        self._side = torch.cuda.Stream(device=dev) if self.is_cuda else None
        self._watches = [_RingWatch(c) for c in canaries]
        self._alarm = False
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
        """After HEAD of ``step``: write this rank's signal row on the device and start the
        all-reduce (``async_op``). ``batch`` None (end of run) digests to 0. Never blocks."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        k = self._launches % len(self._tables)
        table = self._tables[k]
        table.zero_()
        mine = table[self.rank]
        for w in self._watches:
            rows, code = w.take()
            mine[ROWS:ROWS + 1] += rows
            mine[CODE:CODE + 1] |= code
        if self._alarm:
            mine[CODE:CODE + 1] |= ALARM_BIT
        if batch is not None:
            mine[DIGEST:DIGEST + 1].copy_(chain_digest(self.canary.state.records, batch.req_pool_indices,
                                                       batch.extend_lens, batch.out_cache_loc))
        mine[STEP].fill_(step)
        self._alarm = False
        work = dist.all_reduce(table, group=self.group, async_op=True)
        event = None
        if self._side is not None:
            with torch.cuda.stream(self._side):
                work.wait()  # the side stream waits for the collective; the compute stream does not
                self._hosts[k].copy_(table, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        request_ids = tuple(r for r in (batch.request_ids or ()) if r is not None) if batch is not None else ()
        self._in_flight.append(_InFlight(step, k, work, event, request_ids))
        self._launches += 1
        self.seconds += time.perf_counter() - t0

    def end_step(self, step: int) -> AgreedStepReport:
        """The canaries' ``end_step`` (their violations and alarms, merged), then the agreement of
        the signal launched ``lag`` steps ago and the policy on it. Raises ``CanaryViolation``
        (raise) or ``WatchdogTimeout`` on every rank together; ``RanksOutOfStep`` if the ranks'
        steps differ."""
        if not self.enabled:
            return self._merge(step, [c.end_step(step) for c in self.canaries])
        t0 = time.perf_counter()
        for w in self._watches:
            w.settle()  # TAIL rows, before the reporter may reset the ring counter
        self.seconds += time.perf_counter() - t0
        report = self._merge(step, [c.end_step(step) for c in self.canaries])
        for w in self._watches:
            w.rebase()
        return self._agree(report, self.lag)

    def finish(self, step: int) -> AgreedStepReport:
        """End of run: flush the canaries, signal what is left, complete every all-reduce and apply
        the policy. Call on every rank after the last step."""
        report = self._merge(step, [c.flush(step) for c in self.canaries])
        if not self.enabled:
            return report
        self.launch(step, None)
        return self._agree(report, 0)

    def drain(self) -> None:
        """Wait for every all-reduce in flight without acting on it (after an error stopped the run)."""
        while self._in_flight:
            self._in_flight.popleft().work.wait()

    # --- internals -----------------------------------------------------------------------------

    @staticmethod
    def _merge(step: int, reports: list[StepReport]) -> AgreedStepReport:
        violations = [v for r in reports for v in r.violations]
        return AgreedStepReport(step, violations, [a for r in reports for a in r.alarms])

    def _agree(self, report: AgreedStepReport, keep: int) -> AgreedStepReport:
        t0 = time.perf_counter()
        self._alarm = self._alarm or bool(report.alarms)
        self._unacted += report.violations
        try:
            while len(self._in_flight) > keep:
                self._complete(self._in_flight.popleft(), report)
        finally:
            self.seconds += time.perf_counter() - t0
        return report

    def _complete(self, flight: _InFlight, report: AgreedStepReport) -> None:
        if flight.event is not None:
            flight.event.synchronize()  # launched a step ago: normally complete already
            table = self._hosts[flight.buffer].tolist()
        else:
            flight.work.wait()
            table = self._tables[flight.buffer].tolist()
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
        if self.policy not in (Policy.RAISE, Policy.RECOMPUTE):
            self._unacted = []  # log: nothing to act on, nothing to keep
            return
        alarmed = [r for r, row in enumerate(table) if row[CODE] & ALARM_BIT]
        if alarmed:
            raise WatchdogTimeout(f"step {flight.step}: the canary watchdog fired on rank(s) {alarmed}")
        reporting = [r for r, row in enumerate(table) if row[ROWS] > 0]
        if not reporting and not divergences:
            return
        if self.policy is Policy.RAISE:
            where = "; ".join(d.line() for d in divergences) or f"ranks {reporting} reported violations"
            first = f"; first here: {self._unacted[0].line()}" if self._unacted else ""
            raise CanaryViolation(f"step {flight.step}, rank {self.rank} of {self.world}: {where}{first}",
                                  list(self._unacted))
        if self.policy is Policy.RECOMPUTE:
            report.recovery = self._exchange_recovery(flight, divergences)

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
        union = list(dict.fromkeys(r for reqs, _, _ in gathered for r in reqs))
        bad = sorted({s for _, ss, _ in gathered for s in ss})
        return Recovery(tuple(union), tuple(bad), min(s for _, _, s in gathered))
