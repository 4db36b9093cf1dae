"""The reference engine in tensor-parallel mode: one process per rank, KV heads split across ranks.

Every rank runs a whole ``Engine`` (scheduler, prefix cache, host tier, page table) on the same
deterministic schedule; only the model is sharded (``TinyLlama.shard``): rank r keeps query and
KV heads ``[r * n / R, (r + 1) * n / R)`` and the same slice of the MLP, and its pool holds only
its own KV heads. The row-parallel outputs are summed with ``torch.distributed.all_reduce``
before grid rounding, so every rank gets logits equal bit for bit to one unsharded engine's, and
samples the same tokens.

The canary of each rank guards its own pool; ``RankCanaryHooks`` wraps it in a ``RankAgreement``
so that the ranks agree on what any of them saw and apply the policy together.

    dist.init_process_group("gloo", ...)          # one process per rank
    hooks = RankCanaryHooks(CanaryConfig(policy=Policy.RECOMPUTE))
    engine = build_rank_engine(model_config, engine_config, hooks)
    hooks.attach(engine)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import PoolKind
from kvcanary.distributed.agreement import AgreedStepReport, RankAgreement
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.engine.model import TinyLlama
from kvcanary.errors import ConfigError
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, Recovery


def rank_model_config(config: ModelConfig, num_ranks: int) -> ModelConfig:
    """The shape one rank holds: heads, KV heads and MLP width divided by ``num_ranks`` (its pool
    is sized from it). Raises ConfigError when one is not a multiple of ``num_ranks``."""
    for name in ("num_heads", "num_kv_heads", "intermediate"):
        if getattr(config, name) % num_ranks:
            raise ConfigError(f"ModelConfig.{name} ({getattr(config, name)}) must be a multiple of the "
                              f"tensor-parallel ranks ({num_ranks}); choose a model whose heads split evenly")
    return replace(config, num_heads=config.num_heads // num_ranks, num_kv_heads=config.num_kv_heads // num_ranks,
                   intermediate=config.intermediate // num_ranks)


def all_reduce_sum(group: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's reduce over ``group``: an in-place sum of the ranks' partial outputs."""

    def reduce(partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=group)
        return partial

    return reduce


def build_rank_engine(model_config: ModelConfig, engine_config: EngineConfig, hooks: EngineHooks | None = None,
                      group: dist.ProcessGroup | None = None) -> Engine:
    """This process's rank of a tensor-parallel engine over ``group`` (initialised): its pool holds
    ``rank_model_config(model_config, world)``'s KV heads, its model the rank's shard of the model
    drawn from ``model_config``. ``engine_config.device`` is this rank's device."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    engine = Engine(rank_model_config(model_config, world), engine_config, hooks)
    model = TinyLlama(model_config, engine_config.max_ctx, engine.device)
    model.shard(rank, world, all_reduce_sum(group))
    engine.model = model
    return engine


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RankCanaryHooks(CanaryHooks):
    """``CanaryHooks`` whose canaries (full pool, and sliding-window pool if any) run ``Policy.LOG``
    inside a ``RankAgreement`` that applies ``config.policy`` on every rank together: the signal is
    launched right after HEAD and agreed in ``after_forward`` (before sampling; under log and raise
    the table of the step before), where a recompute recovery is handed to the engine. In a
    graph-captured decode step the signal's device half (``RankAgreement.issue``) is captured with
    HEAD and joined at TAIL; after a replay ``after_forward`` runs its host half. ``agreed`` keeps
    every step report with a divergence, ``recoveries`` every recovery applied. Call ``finish()``
    on every rank after the last step."""

    def __init__(self, config: CanaryConfig, group: dist.ProcessGroup | None = None):
        local = config if config.policy in (Policy.OFF, Policy.LOG) else replace(config, policy=Policy.LOG)
        super().__init__(local)
        self.policy, self.group = config.policy, group
        self.agreement: RankAgreement | None = None
        self.agreed: list[AgreedStepReport] = []
        self.recoveries: list[tuple[int, Recovery]] = []  # (step, what every rank recomputed)
        self._launched = False  # this step's signal was launched eagerly (not by a graph replay)

    def attach(self, engine: Engine) -> Canary:
        canary = super().attach(engine)
        window = getattr(self, "window_canary", None)  # a sliding-window pool's canary, if the model has one
        canaries = [canary] if window is None else [canary, window]
        self.agreement = RankAgreement(canaries, self.policy, self.group, slot_map=self._engine_slots)
        return canary

    def _engine_slots(self, pool: PoolKind, slots: list[int]) -> list[int]:
        """Slots of ``pool``'s violations as the engine's (full-pool) slots, for recompute."""
        return self.engine.pool.window.full_slots_of(slots) if pool is PoolKind.SWA else slots

    def before_forward(self, batch: ForwardBatch) -> None:
        super().before_forward(batch)
        self.agreement.prepare(self.step)  # outside any graph: the step the signal carries
        self._launched = False

    def forward_prologue(self, batch: ForwardBatch) -> None:
        super().forward_prologue(batch)  # HEAD
        for canary, _ in self._canaries(batch):
            canary.join()  # HEAD's rows of this step go into this step's signal (HEAD may be on a side stream)
        if _capturing():
            self.agreement.issue(batch)  # the device half only: replays issue it
        else:
            self.agreement.launch(self.step, batch)
            self._launched = True

    def forward_epilogue(self, batch: ForwardBatch) -> None:
        super().forward_epilogue(batch)  # TAIL
        if _capturing():
            self.agreement.join()

    def after_forward(self, batch: ForwardBatch) -> None:
        if not self._launched:  # a graph replay issued this step's signal
            self.agreement.launched(self.step, batch, replayed=True)
        self._take(self.agreement.end_step(self.step))

    def finish(self) -> AgreedStepReport:
        """End of run, on every rank: flush, agree on what is left, apply the policy."""
        report = self.agreement.finish(self.step)
        self._take(report)
        return report

    def _take(self, report: AgreedStepReport) -> None:
        if report.violations or report.alarms:
            self.reports.append(report)
        if report.divergences:
            self.agreed.append(report)
        rec = report.recovery
        if rec is not None and (rec.requests or rec.slots):
            self.recoveries.append((report.step, rec))
            self.engine.apply_recovery(rec)
            self.quarantine(())  # counts what the recovery quarantined in the canary's totals
