"""The reference engine as a service: one background thread steps it, HTTP threads add requests
and wait for them. Every access to the engine holds ``EngineService.lock``.

Under the raise policy (or when the watchdog fires under raise or recompute) the step that found
the problem raises; the service stops stepping, fails every waiting request with that error
(``EngineStopped``) and keeps serving the admin routes, so the incident can be inspected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import CanaryViolation, KVCanaryError
from kvcanary.faults import FAULTS
from kvcanary.faults.hooks import attach_faults
from kvcanary.runtime.canary import Canary, Recovery, WatchdogTimeout
from kvcanary.runtime.sweep import SweepRun
from kvcanary.server.admin import AdminConfig, AdminTarget, CanaryAdmin

log = logging.getLogger("kvcanary.server")


@dataclass(frozen=True)
class ServeConfig:
    """The served engine: model, engine and canary configs, admin options, the model name clients
    send, and how long a completion may wait for its tokens."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_slots=2048, max_ctx=512,
                                                                      chunk_size=64, host_tier_slots=1024))
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    model_name: str = "kv-canary-reference"
    request_timeout_s: float = 120.0

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("ServeConfig.model_name must be a non-empty string, got ''")
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServeConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")


class EngineStopped(KVCanaryError):
    """The engine stopped stepping (raise policy, watchdog); no request can complete."""


class EngineService(AdminTarget):
    """Owns the engine, its canary and fault hooks, the stepping thread and the admin state."""

    def __init__(self, config: ServeConfig):
        self.config = config
        engine, hooks, fault_hooks = attach_faults(lambda h: Engine(config.model, config.engine, h), config.canary,
                                                   ())
        self.engine, self.hooks, self.fault_hooks = engine, hooks, fault_hooks
        super().__init__(hooks.canary, threading.RLock())
        self._wake = threading.Condition(self.lock)
        self.admin = CanaryAdmin(self, config.admin)
        self.error: str | None = None
        self._reports_seen = 0
        self._thread: threading.Thread | None = None
        self._stop = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcanary-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (self.error is not None or not self.engine.has_unfinished):
                    self._wake.wait(0.5)
                if self._stop:
                    return
                try:
                    self.engine.step()
                except (CanaryViolation, WatchdogTimeout) as e:
                    self.error = str(e)
                    for v in getattr(e, "violations", []):
                        self.admin.log.add([v])
                    log.error("kv_canary server: engine stopped: %s", e)
                except Exception as e:  # a stepping thread must not die silently
                    self.error = f"{type(e).__name__}: {e}"
                    log.exception("kv_canary server: engine stopped")
                self._feed_admin()
                self._wake.notify_all()
            time.sleep(0)  # let waiting HTTP threads take the lock between steps

    def _feed_admin(self) -> None:
        reports = self.hooks.reports
        for r in reports[self._reports_seen:]:
            self.admin.record(r)
        self._reports_seen = len(reports)

    # --- completions -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Run ``prompts`` (token ids) for ``max_tokens`` each, batched with whatever else runs;
        returns their output ids. Raises ValueError / CapacityError for requests the engine
        refuses, EngineStopped when it stopped, TimeoutError after ``request_timeout_s``."""
        deadline = time.monotonic() + self.config.request_timeout_s
        with self._wake:
            if self.error is not None:
                raise EngineStopped(f"the engine stopped: {self.error}")
            ids = []
            try:
                for p in prompts:
                    ids.append(self.engine.add_request(p, max_tokens))
            except Exception:
                for rid in ids:
                    self.engine.abort(rid)
                raise
            self._wake.notify_all()
            done = lambda: self.error is not None or all(
                self.engine.requests[i].status in (RequestStatus.FINISHED, RequestStatus.ABORTED) for i in ids)
            if not self._wake.wait_for(done, max(deadline - time.monotonic(), 0)):
                for rid in ids:
                    self.engine.abort(rid)
                raise TimeoutError(f"requests did not finish within {self.config.request_timeout_s} s")
            if self.error is not None:
                raise EngineStopped(f"the engine stopped: {self.error}")
            return [self.engine.output_ids(i) for i in ids]

    # --- AdminTarget ------------------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        return self.engine.step_index

    def canaries(self) -> list[Canary]:
        return [c for c in (self.hooks.canary, getattr(self.hooks, "window_canary", None)) if c is not None]

    def sweep_runs(self) -> list[SweepRun]:
        return [SweepRun(r.slots, r.token_ids, r.start_position, r.prev_slot)
                for r in self.engine.prefix_cache_slots()]

    def slot_owners(self, slot: int) -> list[dict]:
        owners = []
        for req in self.engine.scheduler.running:
            hits = torch.nonzero(req.slots[: req.num_cached] == slot).flatten().tolist()
            owners += [{"request": req.request_id, "position": int(p)} for p in hits]
        if self.engine.tree is not None:
            for node in self.engine.tree.nodes():
                if not node.is_on_host:
                    hits = torch.nonzero(node.slots == slot).flatten().tolist()
                    owners += [{"prefix_cache": True, "position": node.start + int(p), "locks": node.lock_count}
                               for p in hits]
        return owners

    def fault_kinds(self) -> list[str]:
        return list(FAULTS)

    def inject_fault(self, kind: str, params: dict) -> dict:
        """Arm ``FAULTS[kind](**params)``; ``warmup_steps`` counts from now (default 0: the next step)."""
        params = dict(params)
        warmup = params.pop("warmup_steps", 0)
        if type(warmup) is not int or warmup < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup!r}")
        fault = FAULTS[kind](warmup_steps=self.engine.step_index + warmup, **params)
        fault.attach(self.engine, self.canary)
        self.fault_hooks.faults.append(fault)
        log.warning("kv_canary server: fault %s armed from step %d (%s)", kind, self.engine.step_index + warmup,
                    params)
        return {"fault": kind, "armed_from_step": self.engine.step_index + warmup, "params": params}

    def injections(self) -> list[dict]:
        return [{"fault": i.fault, "step": i.step, "slot": i.slot, "detail": i.detail}
                for i in self.fault_hooks.injections]

    def recover(self, recovery: Recovery) -> None:
        known = [r for r in recovery.requests if r in self.engine.requests]
        self.engine.recompute(known, torch.tensor(recovery.slots, dtype=torch.int64), since_step=recovery.since_step)

    def engine_status(self) -> dict:
        e = self.engine
        return {"model": self.config.model_name, "step": e.step_index, "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting), "free_slots": e.pool.num_free_slots,
                "stopped": self.error, "stats": e.stats.as_dict()}
