"""The canary's admin routes: a FastAPI router any engine can mount, or serve alone.

| route                         | auth    | answer                                                        |
|-------------------------------|---------|---------------------------------------------------------------|
| GET  /canary/status           | content | config, totals, device counters, last violations, watchdog    |
| GET  /canary/violations       | content | violations with id >= ``since`` (at most ``limit``), ``next`` |
| GET  /canary/incidents        | content | incident totals, the open incidents and the first ``limit``   |
| POST /canary/sweep            | yes     | sweep every idle cached slot now; what it verified and found  |
| GET  /canary/slots/{slot}     | content | the slot's decoded record and its owners, if known            |
| GET  /canary/faults           | yes*    | fault kinds and injections so far                             |
| POST /canary/faults/{kind}    | yes*    | inject a fault (body: probability, seed, warmup_steps, ...)   |
| GET  /metrics                 |         | Prometheus text exposition of the registry                    |

"auth", with ``AdminConfig.token`` set: "yes": the route needs ``Authorization: Bearer <token>``
(401 without it or with another); "content": open, but cached content (token ids, chains,
fingerprints, stored and expected values) and the ids of the requests that read a slot (engine
and client ids) are shown only with the token (``null`` without).
"*": fault routes answer 403 unless ``AdminConfig.enable_faults`` was set at start-up. Errors
are OpenAI-shaped JSON (``kvcanary.server.errors``) once ``install_error_handlers(app)`` ran.

Every route is ``async``: it hands its work to ``AdminTarget.run`` (``read`` for status and
metrics), which by default runs it on a worker thread with the target's lock held. The served
engine runs ``run`` on its engine thread between steps and ``read`` at once on the event loop, so
status and metrics never wait for a step, let alone a generation.

An engine lends the routes an ``AdminTarget``: its canary, the lock it holds while it steps, and
optional hooks (idle cached runs to sweep, slot owners, fault injection, recovery). It feeds
every ``StepReport`` with violations or alarms to ``CanaryAdmin.record``.
"""

from __future__ import annotations

import hmac
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import APIRouter, Body, FastAPI, Header, Path, Query
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcanary.core.record import CHAIN, FINGERPRINT, PAD_SLOT, POSITION, TOKEN, LaunchPoint, record_words
from kvcanary.errors import CanaryViolation
from kvcanary.runtime.canary import Canary, Recovery, StepReport
from kvcanary.runtime.incidents import incidents_report
from kvcanary.runtime.metrics import CanaryCollector
from kvcanary.runtime.reporting import StepMeta, Violation
from kvcanary.runtime.sweep import SweepRun
from kvcanary.server.errors import ApiError, error_body, install_error_handlers

__all__ = ["AdminConfig", "AdminTarget", "CanaryAdmin", "ViolationLog", "admin_app", "error_body",
           "install_error_handlers"]

CONTENT_FIELDS = ("token", "expected_token", "stored_value", "expected_value")  # of a violation row


@dataclass(frozen=True)
class AdminConfig:
    """``token``: bearer token of the mutating routes and of cached content (None: none).
    ``enable_faults``: serve the fault-injection routes (refused otherwise). ``history``:
    violations kept for ``/canary/violations`` (older ones are dropped and counted)."""

    token: str | None = None
    enable_faults: bool = False
    history: int = 4096

    def __post_init__(self):
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError(f"AdminConfig.token must be a non-empty string or None, got {self.token!r}")
        if type(self.history) is not int or self.history < 1:
            raise ValueError(f"AdminConfig.history must be an int >= 1, got {self.history!r}")


class AdminTarget:
    """What an engine lends the admin routes. ``canary`` and ``lock`` are required; override the
    rest as the engine can. Every method is called with ``lock`` held."""

    def __init__(self, canary: Canary, lock: threading.RLock):
        self.canary, self.lock = canary, lock

    async def run(self, fn: Callable):
        """Run ``fn()`` with ``lock`` held, off the event loop; returns its result."""
        def locked():
            with self.lock:
                return fn()
        return await anyio.to_thread.run_sync(locked)

    async def read(self, fn: Callable):
        """Run the read-only ``fn()`` (status, metrics); default: like ``run``. An engine whose
        admin state can be read while it steps may run it at once, on the event loop."""
        return await self.run(fn)

    @property
    def step_index(self) -> int:
        """The engine's next step (names the step of an out-of-band sweep)."""
        return 0

    def canaries(self) -> list[Canary]:
        """Every canary of the engine, one per KV pool, for the metrics (default: ``canary``)."""
        return [self.canary]

    def sweep_runs(self) -> Sequence[SweepRun]:
        """Runs of idle cached slots to sweep (default: none)."""
        return []

    def slot_owners(self, slot: int) -> list[dict] | None:
        """Who holds ``slot``: ``[{"request": id, "position": p}, {"prefix_cache": True, ...}]``; None: unknown."""
        return None

    def fault_kinds(self) -> list[str]:
        return []

    def inject_fault(self, kind: str, params: dict) -> dict:
        """Arm fault ``kind`` with ``params``; returns what was armed. Raises ValueError or TypeError for bad params."""
        raise ValueError("this engine cannot inject faults")

    def injections(self) -> list[dict]:
        return []

    def recover(self, recovery: Recovery) -> None:
        """Act on the recompute policy's ``Recovery`` found by an out-of-band sweep (default: nothing)."""

    def quarantine(self, violations: list) -> None:
        """Take the slots ``violations`` (found by an out-of-band sweep) name as damaged out of the
        engine's prefix cache, under every policy (default: nothing)."""

    def engine_status(self, reveal: bool = True) -> dict:
        """The engine's state for ``/canary/status``; without ``reveal``, nothing that names a
        request or shows cached content."""
        return {}


class ViolationLog:
    """The last ``capacity`` violations, each with an increasing id (thread-safe)."""

    def __init__(self, capacity: int):
        self._rows: deque[dict] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.next_id = 0

    def add(self, violations: Sequence[Violation], names: Mapping | None = None) -> None:
        """Keep ``violations``; ``names`` (engine request id -> client id) names their requests."""
        with self._lock:
            for v in violations:
                row = {"id": self.next_id, **v.to_json()}
                if names is not None:
                    for owner in row["requests"]:
                        owner["client"] = names.get(owner["request"])
                self._rows.append(row)
                self.next_id += 1

    def since(self, first_id: int, limit: int) -> tuple[list[dict], int, int]:
        """(rows with id >= first_id, at most ``limit``; the id to ask for next; ids dropped before ``first_id``)."""
        with self._lock:
            oldest = self._rows[0]["id"] if self._rows else self.next_id
            rows = [r for r in self._rows if r["id"] >= first_id][:limit]
            nxt = rows[-1]["id"] + 1 if rows else max(first_id, oldest)
            return rows, nxt, max(0, oldest - first_id)

    def last(self, n: int) -> list[dict]:
        with self._lock:
            return list(self._rows)[-n:]


def redact(rows: list[dict]) -> list[dict]:
    """Violation rows without their cached content (token ids, stored and expected values) and
    without the ids of their requests (engine and client ids; an idle cached slot's ``"cache"``
    and the positions stay)."""
    return [{**r, **dict.fromkeys(CONTENT_FIELDS), "requests": [_anonymous(o) for o in r.get("requests", [])]}
            for r in rows]


def _anonymous(owner: dict) -> dict:
    """A slot owner without the request's ids (``"cache"`` names no request and stays)."""
    return {**owner, "request": "cache" if owner.get("request") == "cache" else None,
            **({"client": None} if "client" in owner else {})}


Auth = Annotated[str | None, Header(alias="Authorization", description="Bearer <token>")]


class CanaryAdmin:
    """The admin routes of one canary. ``registry``: where ``/metrics`` reads (default: a new
    registry holding a ``CanaryCollector`` of the target's canaries)."""

    def __init__(self, target: AdminTarget, config: AdminConfig = AdminConfig(),
                 registry: CollectorRegistry | None = None):
        self.target, self.config = target, config
        if registry is None:
            registry = CollectorRegistry()
            registry.register(CanaryCollector(target.canaries(), lock=target.lock))
        self.registry = registry
        self.log = ViolationLog(config.history)
        self.alarms: deque[dict] = deque(maxlen=100)

    # --- feeding -------------------------------------------------------------------------------

    def record(self, report: StepReport) -> None:
        """Keep the violations and watchdog alarms of a step report."""
        self.log.add(report.violations, getattr(self.target.canary, "request_names", None))
        launches = self.target.canary.counters()
        for a in report.alarms:
            self.alarms.append({"step": report.step, "point": a.point.name, "silent_steps": a.silent_steps,
                                "window": a.window, "launches": launches[a.point.name]["launches"]})

    # --- route bodies (lock held) -----------------------------------------------------------------

    def status(self, reveal: bool = True) -> dict:
        c = self.target.canary
        cfg, t, counters = c.config, c.totals, c.counters()
        alarms = list(self.alarms)
        silent = sorted({a["point"] for a in alarms if counters[a["point"]]["launches"] == a["launches"]})
        last = self.log.last(10)
        return {
            "config": {"policy": cfg.policy.value, "real_kv": cfg.real_kv.name.lower(),
                       "sweep_interval": cfg.sweep_interval, "sweep_budget_bytes": cfg.sweep_budget_bytes,
                       "truth": cfg.truth, "ring_capacity": cfg.ring_capacity, "stats_period": cfg.stats_period,
                       "pool": c.pool.name, "num_slots": c.geometry.num_slots, "device": c.geometry.device},
            "admin": {"auth": self.config.token is not None, "faults_enabled": self.config.enable_faults},
            "totals": {"steps": t.steps, "forwards": t.forwards,
                       "sweeps": sum(x.totals.sweeps for x in self.target.canaries()), "violations": t.violations,
                       "by_reason": dict(t.by_reason), "by_launch_point": dict(t.by_launch_point),
                       "recomputed_requests": t.recomputed_requests, "watchdog_alarms": t.watchdog_alarms,
                       "seconds": t.seconds},
            "counters": counters,
            "last_violations": last if reveal else redact(last),
            "watchdog": {"window": cfg.watchdog_steps, "state": "alarm" if silent else "ok",
                         "silent_points": silent, "alarms": alarms[-10:],
                         "launches": {p.name: counters[p.name]["launches"] for p in LaunchPoint}},
            "engine": self.target.engine_status(reveal),
        }

    def sweep(self) -> dict:
        """Sweep every idle cached run now (up to the sweep plan's capacity) and read the result at
        once: the slots queued, the runs, and the violations found (recorded like any other)."""
        t = self.target
        c = t.canary
        if not c.config.enabled:
            raise ApiError(409, "the canary is off (policy off); start with another policy to sweep")
        runs = list(t.sweep_runs())
        cached = sum(int(r.slots.numel()) for r in runs)
        n = c.sweep(runs, budget_bytes=max(cached, 1) * c.entry_bytes())
        owners = {int(s): r.start_position + i for r in runs for i, s in enumerate(r.slots.tolist())}
        step = t.step_index
        c.reporter.snapshot(StepMeta(step, sweep_slots=owners))
        stopped = None
        try:
            report = c.flush(step)
        except CanaryViolation as e:  # raise policy: report it, the engine decides what stops
            report, stopped = StepReport(step, list(e.violations)), str(e)
        self.record(report)
        if report.recovery is not None:
            t.recover(report.recovery)
        if report.violations:
            t.quarantine(report.violations)
        return {"step": step, "runs": len(runs), "cached_slots": cached, "verified_slots": n,
                "violations": [v.to_json() for v in report.violations], "raised": stopped}

    def slot(self, slot: int, reveal: bool = True) -> dict:
        c = self.target.canary
        n = c.geometry.num_slots
        if not 0 <= slot < n:
            raise ApiError(404, f"slot {slot} is outside the pool's slots [0, {n})", "slot")
        w = [int(x) for x in record_words(c.state.records[slot : slot + 1].cpu())[0].tolist()]
        hexa = lambda x: f"0x{x & (2**64 - 1):016x}" if reveal else None
        return {"slot": slot, "reserved": slot == PAD_SLOT, "stamped": any(w), "token": w[TOKEN] if reveal else None,
                "position": w[POSITION], "chain": hexa(w[CHAIN]), "fingerprint": hexa(w[FINGERPRINT]),
                "owners": self._owners(slot, reveal), "content_shown": reveal}

    def _owners(self, slot: int, reveal: bool) -> list[dict] | None:
        owners = self.target.slot_owners(slot)
        return owners if reveal or owners is None else [_anonymous(o) for o in owners]

    def inject(self, kind: str, params: dict) -> dict:
        kinds = self.target.fault_kinds()
        if kind not in kinds:
            raise ApiError(404, f"unknown fault kind {kind!r}; choose from {', '.join(kinds)}", "kind")
        try:
            return self.target.inject_fault(kind, params)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"bad parameters for fault {kind!r}: {e}", "body") from None

    # --- access ----------------------------------------------------------------------------------

    def is_authorized(self, authorization: str | None) -> bool:
        """True when no token is configured or ``authorization`` carries it."""
        token = self.config.token
        if token is None:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        return hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), token.encode())

    def authorize(self, authorization: str | None) -> None:
        """Raise 401 unless ``is_authorized(authorization)``."""
        if self.is_authorized(authorization):
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise ApiError(401, "this route needs a bearer token: send 'Authorization: Bearer <token>'",
                           "Authorization", headers={"WWW-Authenticate": "Bearer"})
        raise ApiError(401, "the bearer token is not the one the server was started with", "Authorization",
                       headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})

    def _faults_allowed(self, authorization: str | None) -> None:
        if not self.config.enable_faults:
            raise ApiError(403, "fault injection is disabled; start the server with fault injection enabled "
                                "(kv-canary serve --enable-faults)")
        self.authorize(authorization)

    # --- the router ------------------------------------------------------------------------------

    def incidents(self, limit: int, reveal: bool) -> dict:
        """Incident totals, the open incidents and the first ``limit``; each first violation's
        cached content only when ``reveal``."""
        canaries = self.target.canaries()
        report = incidents_report(canaries, limit)
        report["open_incidents"] = [i.to_json() for c in canaries for i in c.incidents.open_incidents()][:limit]
        if not reveal:
            for key in ("first_incidents", "open_incidents"):
                report[key] = [{**i, "first_violation": redact([i["first_violation"]])[0]} for i in report[key]]
        return report

    def router(self, include_metrics: bool = True) -> APIRouter:
        """The routes of the module table; ``include_metrics=False`` leaves ``/metrics`` to the host app."""
        r = APIRouter()
        run, read = self.target.run, self.target.read

        @r.get("/canary/status")
        async def status(authorization: Auth = None) -> dict:
            reveal = self.is_authorized(authorization)
            return await read(lambda: self.status(reveal))

        @r.get("/canary/violations")
        async def violations(since: Annotated[int, Query(ge=0, description="first violation id (the 'next' of "
                                                         "the previous answer)")] = 0,
                             limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                             authorization: Auth = None) -> dict:
            rows, nxt, dropped = self.log.since(since, limit)
            return {"violations": rows if self.is_authorized(authorization) else redact(rows), "next": nxt,
                    "dropped": dropped}

        @r.get("/canary/incidents")
        async def incidents(limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                            authorization: Auth = None) -> dict:
            reveal = self.is_authorized(authorization)
            return await run(lambda: self.incidents(limit, reveal))

        @r.post("/canary/sweep")
        async def sweep(authorization: Auth = None) -> dict:
            self.authorize(authorization)
            return await run(self.sweep)

        @r.get("/canary/slots/{slot}")
        async def slot(slot: Annotated[int, Path(description="slot index in the pool")],
                       authorization: Auth = None) -> dict:
            reveal = self.is_authorized(authorization)
            return await run(lambda: self.slot(slot, reveal))

        @r.get("/canary/faults")
        async def faults(authorization: Auth = None) -> dict:
            self._faults_allowed(authorization)
            return await run(lambda: {"kinds": self.target.fault_kinds(), "injections": self.target.injections()})

        @r.post("/canary/faults/{kind}")
        async def inject(kind: str, authorization: Auth = None,
                         params: Annotated[dict | None, Body(description="fault parameters")] = None) -> dict:
            self._faults_allowed(authorization)
            return await run(lambda: self.inject(kind, params or {}))

        if include_metrics:
            @r.get("/metrics")
            async def metrics() -> Response:
                return Response(await read(lambda: generate_latest(self.registry)), media_type=CONTENT_TYPE_LATEST)

        return r


def admin_app(admin: CanaryAdmin) -> FastAPI:
    """The admin routes served alone (bind it to 127.0.0.1: ``uvicorn.run(app, host="127.0.0.1")``)."""
    app = FastAPI(title="kv-canary admin")
    install_error_handlers(app)
    app.include_router(admin.router())
    return app
