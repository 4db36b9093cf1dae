"""Wire a Canary into the reference engine through its public hooks, as any engine would.

HEAD runs in ``before_forward`` (after a sweep when one is due), TAIL and the step's report in
``after_forward``, so on the CPU a violation is known before the step samples: under the
recompute policy the affected requests are retracted there and produce no token from the
corrupted forward. Offload and load-back move the records with the K/V rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import Half
from kvcanary.engine.hooks import EngineHooks
from kvcanary.ops.fingerprint import KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry, StepReport
from kvcanary.runtime.sweep import SweepRun

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine


def pool_sources(engine: Engine, config: CanaryConfig) -> list[KVSource]:
    """KV sources of the covered layers and halves (default: first and last layer)."""
    n = engine.model_config.num_layers
    layers = config.layers if config.layers is not None else tuple(dict.fromkeys((0, n - 1)))
    for layer in layers:
        if not 0 <= layer < n:
            raise ValueError(f"CanaryConfig.layers has {layer}, outside the model's [0, {n}) layers")
    buffers = {Half.K: engine.pool.k_buffers, Half.V: engine.pool.v_buffers}
    return [KVSource.from_buffer(buffers[h][layer], half=h, layer=layer) for layer in layers for h in config.halves]


class CanaryHooks(EngineHooks):
    """EngineHooks that drive a Canary. Build the engine with ``hooks=CanaryHooks(config)`` and
    call ``hooks.attach(engine)`` (``attach_canary`` does both)."""

    def __init__(self, config: CanaryConfig):
        self.config = config
        self.engine: Engine | None = None
        self.canary: Canary | None = None
        self.step = 0
        self.reports: list[StepReport] = []

    def attach(self, engine: Engine) -> Canary:
        cfg = engine.config
        geometry = PoolGeometry(cfg.num_slots, cfg.max_rows, cfg.max_ctx, str(engine.device))
        self.engine = engine
        self.canary = Canary(self.config, geometry, sources=pool_sources(engine, self.config))
        if engine.host_tier is not None:
            self.canary.attach_host_tier(cfg.host_tier_slots)
        return self.canary

    def before_forward(self, batch: ForwardBatch) -> None:
        if self.canary.sweep_due(self.step):
            runs = [SweepRun(r.slots, r.token_ids, r.start_position, r.prev_slot)
                    for r in self.engine.prefix_cache_slots()]
            self.canary.sweep(runs)
        self.canary.head(batch)

    def after_forward(self, batch: ForwardBatch) -> None:
        self.canary.tail(batch)
        report = self.canary.end_step(self.step)
        if report.violations or report.alarms:
            self.reports.append(report)
        if report.recovery is not None:
            rec = report.recovery
            known = [r for r in rec.requests if r in self.engine.requests]
            self.engine.recompute(known, torch.tensor(rec.slots, dtype=torch.int64), since_step=rec.since_step)

    def after_step(self, step_index: int) -> None:
        self.step = step_index + 1

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.canary.offload(device_slots, host_rows)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.canary.load_back(host_rows, device_slots)


def attach_canary(engine_factory, config: CanaryConfig):
    """Build an engine with a canary: ``engine_factory(hooks)`` returns the Engine. Returns (engine, hooks)."""
    hooks = CanaryHooks(config)
    engine = engine_factory(hooks)
    hooks.attach(engine)
    return engine, hooks
