"""Shared helpers of the engine tests: small configs, seeded prompts, recording hooks."""

from __future__ import annotations

import torch

from kvcanary.engine import Engine, EngineConfig, EngineHooks, ModelConfig
from kvcanary.runtime.batch import ForwardBatch

SMALL = dict(num_slots=1024, max_rows=17, max_ctx=128, chunk_size=16, max_tokens_per_step=64, max_running=8)


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**(SMALL | overrides))


def make_engine(hooks: EngineHooks | None = None, model: ModelConfig | None = None, **overrides) -> Engine:
    return Engine(model or ModelConfig(), engine_config(**overrides), hooks)


def random_prompts(
    seed: int, num: int, min_len: int = 4, max_len: int = 40, prefix_len: int = 0
) -> list[list[int]]:
    """``num`` prompts of random ids (lengths in [min_len, max_len]) after a shared random prefix."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (prefix_len,), generator=gen).tolist()
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [prefix + torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def run_logits(engine: Engine, check: bool = True) -> dict[int, list[torch.Tensor]]:
    """Run to completion (``check``: with integrity checks after each step); returns request id ->
    logits of each sampled token."""
    out: dict[int, list[torch.Tensor]] = {}
    while engine.has_unfinished:
        result = engine.step()
        for rid, logits in result.logits.items():
            out.setdefault(rid, []).append(logits.clone())
        if check:
            engine.check_integrity()
    return out


def kv_bytes(engine: Engine, slots: torch.Tensor) -> torch.Tensor:
    """uint8[n, bytes] of every layer's K and V at ``slots``."""
    pool, slots = engine.pool, slots.to(engine.device)
    parts = [buf[slots].reshape(len(slots), -1) for buf in pool.k_buffers + pool.v_buffers]
    return torch.cat(parts, dim=1).contiguous().view(torch.uint8).cpu()


class RecordingHooks(EngineHooks):
    """Records every hook call as (name, args) and runs optional callbacks; reads the token truth
    (the engine builds it, as for a canary)."""

    reads_token_truth = True

    def __init__(self, on_before=None):
        self.events: list[tuple[str, tuple]] = []
        self.on_before = on_before

    def before_forward(self, batch: ForwardBatch) -> None:
        self.events.append(("before_forward", (batch,)))
        if self.on_before is not None:
            self.on_before(batch)

    def forward_prologue(self, batch: ForwardBatch) -> None:
        self.events.append(("forward_prologue", (batch,)))

    def forward_epilogue(self, batch: ForwardBatch) -> None:
        self.events.append(("forward_epilogue", (batch,)))

    def after_forward(self, batch: ForwardBatch) -> None:
        self.events.append(("after_forward", (batch,)))

    def after_step(self, step_index: int) -> None:
        self.events.append(("after_step", (step_index,)))

    def before_move(self) -> None:
        self.events.append(("before_move", ()))

    def on_offload(self, device_slots, host_rows) -> None:
        self.events.append(("on_offload", (device_slots.clone(), host_rows.clone())))

    def on_load(self, host_rows, device_slots) -> None:
        self.events.append(("on_load", (host_rows.clone(), device_slots.clone())))

    def on_free(self, slots) -> None:
        self.events.append(("on_free", (slots.clone(),)))

    def on_retire(self, slots) -> None:
        self.events.append(("on_retire", (slots.clone(),)))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]
