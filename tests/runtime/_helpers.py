"""Shared helpers of the runtime tests: a small built-in workload with the canary on, and a canary
whose first rows were prefilled by one forward (the sweep tests)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import Half
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runs.setup import RunSetup
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

# (device, fused) of a canary's three paths: the CPU ops one by one, the interpreted Triton kernels
# on the CPU, the kernels on CUDA
PATHS = [pytest.param("cpu", False, id="cpu-ops"),
         pytest.param("cpu", True, id="cpu-triton", marks=pytest.mark.skipif(
             torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case runs the kernel)")),
         pytest.param("cuda", None, id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")])]


def small_setup(num_requests: int = 32, seed: int = 0, engine: dict | None = None, **canary) -> RunSetup:
    """The built-in workload of ``num_requests`` (enough to evict, offload and load back from 24 on)
    with a canary of ``canary`` overrides (sweeps every 4 steps by default)."""
    workload = builtin_workload(WorkloadConfig(num_requests=num_requests, seed=seed))
    config = CanaryConfig(**({"sweep_interval": 4} | canary))
    return RunSetup(ModelConfig(seed=seed), engine_config_for(workload, **(engine or {})), config, workload)


def prefilled(seed: int, device: str, num_slots: int, ctx: int, min_len: int, max_tokens: int,
              fused: bool | None = None, rows: int = 4, warmup: bool = True,
              **config) -> tuple[Canary, list[list[int]], list[list[int]]]:
    """A canary (partial fingerprints of one K source; ``config``: more CanaryConfig fields) whose
    rows 1..3 were prefilled by one forward with random slots, tokens and K/V, ``min_len`` to
    ``ctx`` tokens each: their slots and tokens."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_slots, 2, 16, generator=gen).to(device, torch.bfloat16)
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=4, max_tokens=max_tokens, sweep_interval=0,
                          fused=fused, **config)
    c = Canary(config, PoolGeometry(num_slots, rows, ctx, device), sources=[KVSource.from_buffer(kv, half=Half.K)],
               warmup=warmup)
    lens = torch.randint(min_len, ctx, (3,), generator=gen).tolist()
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    slots, tokens, at = [], [], 0
    for n in lens:
        slots.append(perm[at: at + n])
        tokens.append(torch.randint(0, 30_000, (n,), generator=gen).tolist())
        at += n
    table = torch.zeros(rows, ctx, dtype=torch.int32)
    for r, s in enumerate(slots, start=1):
        table[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
    b = ForwardBatch(i64([1, 2, 3]), i64([0, 0, 0]), i64(lens), table.to(device), i64(sum(tokens, [])),
                     i64([p for n in lens for p in range(n)]), i64(sum(slots, [])))
    with c.forward(b):
        kv[b.out_cache_loc] = torch.randn(b.out_cache_loc.numel(), 2, 16, generator=gen).to(device, torch.bfloat16)
    c.end_step(0)
    return c, slots, tokens


def read_all(c: Canary, step: int) -> list:
    """The violations of what ran since the last report: the step's end, then everything pending."""
    return c.end_step(step).violations + c.flush(step + 1).violations
