"""``FaultHooks``: an ``EngineHooks`` that runs faults around another set of hooks (the canary's).

Within a step: ``before_forward`` runs every fault's ``before_forward`` and then the inner hooks'
(sweep, HEAD's host half); ``forward_prologue`` runs the inner hooks' (HEAD launch) and then every
fault's ``after_head``; ``forward_epilogue`` every fault's ``before_tail`` and then the inner
hooks' (TAIL launch; where the inner hooks start TAIL inside the model, ``layer_done`` of that
layer runs the faults' ``before_tail`` first); ``after_forward`` runs the inner hooks' (step report) and then every
fault's ``after_forward`` (after handing them the violations the inner hooks reported for the forward,
if any: ``on_report``); ``before_move`` reaches the inner hooks only; ``on_offload`` / ``on_load`` /
``on_free`` reach the inner hooks, then the
faults (so their injections follow moved slots). ``after_step`` goes to the inner hooks only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.hooks import EngineHooks
from kvcanary.faults.base import Fault, Injection
from kvcanary.runtime.batch import ForwardBatch

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine


_TABLES_KEPT = 2  # steps of page tables kept past their forward: reports come at most a step late


class FaultHooks(EngineHooks):
    def __init__(self, inner: EngineHooks, faults: Sequence[Fault]):
        self.inner, self.faults = inner, list(faults)
        self.engine: Engine | None = None
        self._num_reports = 0  # reports of the inner hooks already handed to the faults
        self._tail_faults_ran = False  # this forward's before_tail ran (at the layer where TAIL starts)
        self._tables: dict[int, tuple] = {}  # step -> (request ids, page-table rows) of its forward

    def attach(self, engine: Engine) -> None:
        """Give every fault the engine and the inner hooks' canary (if they drive one)."""
        self.engine = engine
        canary = getattr(self.inner, "canary", None)
        for fault in self.faults:
            fault.attach(engine, canary)

    @property
    def reads_token_truth(self) -> bool:
        """The inner hooks' (the faults read no token truth)."""
        return self.inner.reads_token_truth

    @property
    def injections(self) -> list[Injection]:
        return sorted((i for f in self.faults for i in f.injections), key=lambda i: i.step)

    def before_forward(self, batch: ForwardBatch) -> None:
        for fault in self.faults:
            fault.before_forward(batch, self.engine.step_index)
        self.inner.before_forward(batch)

    def forward_prologue(self, batch: ForwardBatch) -> None:
        self.inner.forward_prologue(batch)
        for fault in self.faults:
            fault.after_head(batch, self.engine.step_index)

    def layer_done(self, batch: ForwardBatch, layer: int) -> None:
        if layer == getattr(self.inner, "tail_layer", None):  # TAIL starts here: the faults go first
            self._before_tail(batch)
        self.inner.layer_done(batch, layer)

    def forward_epilogue(self, batch: ForwardBatch) -> None:
        if not self._tail_faults_ran:
            self._before_tail(batch)
        self._tail_faults_ran = False
        self.inner.forward_epilogue(batch)

    def _before_tail(self, batch: ForwardBatch) -> None:
        for fault in self.faults:
            fault.before_tail(batch, self.engine.step_index)
        self._tail_faults_ran = True

    def after_forward(self, batch: ForwardBatch) -> None:
        # the inner hooks may retract requests (recompute policy), clearing their page-table rows
        step, injected = self.engine.step_index, bool(self.injections)
        if self.faults:
            self._tables[step] = (batch.request_ids or (), batch.req_to_token[batch.req_pool_indices].clone())
        self.inner.after_forward(batch)
        reports = getattr(self.inner, "reports", [])
        violations = [v for r in reports[self._num_reports:] for v in r.violations]
        self._num_reports = len(reports)
        # a report a step late (CUDA) names the rows of its own step: hand each step's violations
        # over with that step's page tables, not with this forward's
        by_step: dict[int, list] = {}
        for v in violations:
            by_step.setdefault(v.step, []).append(v)
        for fault in self.faults:
            if injected:
                for s, vs in by_step.items():
                    fault.on_report(*self._tables.get(s, self._tables[step]), vs)
            fault.after_forward(batch, step)
        for s in [s for s in self._tables if s < step - _TABLES_KEPT]:
            del self._tables[s]

    def after_step(self, step_index: int) -> None:
        self.inner.after_step(step_index)

    def before_move(self) -> None:
        self.inner.before_move()

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.inner.on_offload(device_slots, host_rows)
        for fault in self.faults:
            fault.on_offload(device_slots, host_rows)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.inner.on_load(host_rows, device_slots)
        for fault in self.faults:
            fault.on_load(host_rows, device_slots)

    def on_free(self, slots: torch.Tensor) -> None:
        self.inner.on_free(slots)
        for fault in self.faults:
            fault.on_free(slots)

    def on_retire(self, slots: torch.Tensor) -> None:
        self.inner.on_retire(slots)


def attach_faults(engine_factory: Callable[[EngineHooks], Engine], config: CanaryConfig,
                  faults: Sequence[Fault]) -> tuple[Engine, CanaryHooks, FaultHooks]:
    """Build an engine whose canary runs inside ``faults``: ``engine_factory(hooks)`` returns the
    Engine. Returns (engine, canary hooks, fault hooks)."""
    canary_hooks = CanaryHooks(config)
    fault_hooks = FaultHooks(canary_hooks, faults)
    engine = engine_factory(fault_hooks)
    canary_hooks.attach(engine)
    fault_hooks.attach(engine)
    return engine, canary_hooks, fault_hooks
