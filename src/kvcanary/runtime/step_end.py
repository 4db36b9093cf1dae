"""The end of a step: the device's counters read (one step late on CUDA), violations decoded and
grouped into incidents, the watchdog fed, the device's error flags taken, the lines logged, the
policy applied (``runtime.policy``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcanary.config import Policy
from kvcanary.core.record import STAT_CHECKED, STAT_STAMPED, LaunchPoint, Reason
from kvcanary.errors import DeviceError
from kvcanary.ops.state import DeviceFlag
from kvcanary.runtime.context import CanaryContext
from kvcanary.runtime.cpu_forward import CpuForward
from kvcanary.runtime.forward import Forward
from kvcanary.runtime.holds import Holds
from kvcanary.runtime.incidents import Incident
from kvcanary.runtime.policy import Recovery, decide_report
from kvcanary.runtime.reporting import Reporter, StepMeta, Violation
from kvcanary.runtime.watchdog import Watchdog, WatchdogAlarm

log = logging.getLogger("kvcanary")


@dataclass
class StepReport:
    step: int
    violations: list[Violation] = field(default_factory=list)
    alarms: list[WatchdogAlarm] = field(default_factory=list)
    recovery: Recovery | None = None
    incidents: list[Incident] = field(default_factory=list)  # opened by this report's violations
    device_flags: int = 0  # DeviceFlag bits the kernels raised (one step late on CUDA)


@dataclass(eq=False)
class StepEnd:
    """``Canary.end_step`` and ``flush`` over the canary's parts; ``names``: engine request id ->
    the client's id, for the lines (``Canary.request_names``); ``overflow``: the forward plan's
    overflow word (None: the route keeps no plan)."""

    ctx: CanaryContext
    reporter: Reporter
    watchdog: Watchdog
    route: Forward
    holds: Holds
    cpu: CpuForward | None = None
    names: Mapping = field(default_factory=dict)

    def end_step(self, step: int) -> StepReport:
        report = StepReport(step)
        ctx = self.ctx
        config, route = ctx.config, self.route
        if config.policy is Policy.OFF:
            return report
        t0 = time.perf_counter()
        if route.scatter_for is not None:
            route.missed_eager_head()
        if route.side_busy:
            route.join()  # the counters are copied on the current stream
        self.holds.drop()
        meta, reporter = ctx.step, self.reporter
        meta.step = step
        on_cuda = route.on_cuda
        if not on_cuda and reporter.read_in_place:  # the CPU: counters read where they are, without numpy
            report.violations = reporter.read_host(meta)
        else:
            report.violations = reporter.advance(meta, route.replays, route.tail_current)
        ctx.step = StepMeta(step + 1)
        totals = ctx.totals
        totals.steps += 1
        report.alarms = self.watchdog.observe_tags(reporter.host_launches(), reporter.point_tags)
        route.replays, route.tail_current = 0, False
        if not on_cuda:
            report.device_flags = self.read_device_flags()
        elif reporter.flags_read:  # CUDA: read with the counters
            report.device_flags = self._take_device_flags(reporter.flags_read)
        # ``_log_due``, inlined: a clean step makes as few Python calls as it can (between a model's
        # launches each costs µs: its code is out of the caches)
        period, every = config.stats_period, config.incident_summary_steps
        if (report.violations or report.alarms or ctx.incidents.pending or (period and step % period == 0)
                or (every and step % every == 0)):
            self.account(report, upto_step=step - reporter.lag)
        totals.seconds += time.perf_counter() - t0
        if report.device_flags:
            self._report_device_flags(report)
        if report.violations or report.alarms:  # a clean step has no policy to apply
            self.apply_policy(report)
        return report

    def flush(self, step: int) -> StepReport:
        route = self.route
        if route.scatter_for is not None:
            route.scatter_pending()
        route.join()
        report = StepReport(step, self.reporter.collect(flush=True))
        report.device_flags = self.read_device_flags(flush=True)
        self.account(report, upto_step=step, summary=True)
        self._report_device_flags(report)
        self.apply_policy(report)
        return report

    def apply_policy(self, report: StepReport) -> None:
        report.recovery = decide_report(self.ctx.config.policy, report.violations, report.alarms)
        if report.recovery is not None:
            self.ctx.totals.recomputed_requests += len(report.recovery.requests)

    def read_device_flags(self, flush: bool = False) -> int:
        """The error flags the kernels raised (on CUDA: as of the snapshots the reporter just read,
        a step old, copied with the counters without a sync; everything when ``flush``), then
        cleared; a WORKSPACE flag also resets the workspaces."""
        err = self.ctx.state.error
        if err.is_cuda and not flush:
            bits = self.reporter.flags_read
        elif self.cpu is not None:  # the same word through numpy: no torch dispatch a step
            bits = self.cpu.error[0]
        else:
            bits = int(err[0])  # on CUDA this syncs: the end of a run
        return self._take_device_flags(bits) if bits else 0

    def _take_device_flags(self, bits: int) -> int:
        """Clear the error flags ``bits`` were read from (a WORKSPACE flag also resets the
        workspaces); returns ``bits``."""
        state = self.ctx.state
        state.error.zero_()
        if bits & DeviceFlag.WORKSPACE:
            for ws in state.workspaces:
                ws.reset()
        return bits

    def _report_device_flags(self, report: StepReport) -> None:
        if not report.device_flags:
            return
        line = (f"kv_canary device error: step={report.step} flags={'+'.join(DeviceFlag.names(report.device_flags))} "
                "checks of this step are incomplete")
        self.ctx.totals.device_errors += 1
        log.error(line)
        if self.ctx.config.policy in (Policy.RAISE, Policy.RECOMPUTE):
            raise DeviceError(line)

    def account(self, report: StepReport, upto_step: int, summary: bool = False) -> None:
        """Totals, incidents and log lines of a report: a WARNING violation line for each
        violation that opens an incident, DEBUG for re-detections (counted into the periodic
        incident summary line, WARNING too)."""
        ctx = self.ctx
        t, incidents = ctx.totals, ctx.incidents
        for v, opened in incidents.observe(report.violations, upto_step):
            t.violations += 1
            t.by_launch_point[v.point.name] += 1
            for name in Reason.names(v.reasons):
                t.by_reason[name] += 1
                t.by_label[name, v.point.name, v.tag.pool.name] += 1
            report.incidents += opened
            log.log(logging.WARNING if opened else logging.DEBUG, v.line(self.names))
        for a in report.alarms:
            t.watchdog_alarms += 1
            log.error(a.line())
        period = ctx.config.stats_period
        if period and report.step % period == 0:
            log.info(self.stats_line(report.step))
        every = ctx.config.incident_summary_steps
        if summary or (every and report.step % every == 0):
            line = incidents.summary_line(report.step)
            if line is not None:  # rate-limited: at most one per incident_summary_steps, only with news
                log.warning(line)

    def counters(self) -> dict:
        """Device counters as of the last snapshot read: launches, checked and stamped slots by point."""
        s = self.reporter.latest_stats
        out = {}
        for p in LaunchPoint:
            rows = s[4 * p: 4 * p + 4]
            out[p.name] = {"launches": int(rows[:, 0].sum()), "checked": int(rows[:, STAT_CHECKED].sum()),
                           "stamped": int(rows[:, STAT_STAMPED].sum())}
        out["ring_total"] = self.reporter.latest_total
        out["dropped"] = self.reporter.dropped
        plan = self.route.plan
        out["plan_overflows"] = int(plan.overflow[0]) if plan is not None else 0
        return out

    def stats_line(self, step: int) -> str:
        c = self.counters()
        verified = sum(c[p.name]["checked"] for p in LaunchPoint)
        return (f"kv_canary stats: step={step} protected_tokens={c['HEAD']['stamped']} verified_slots={verified} "
                f"sweeps={self.ctx.totals.sweeps} violations={self.ctx.totals.violations} dropped={c['dropped']} "
                f"plan_overflows={c['plan_overflows']}")
