"""The built-in workload: requests that exercise every path the canary guards.

``builtin_workload(WorkloadConfig(...))`` is deterministic in its seed:

| feature              | how                                                                     |
|----------------------|-------------------------------------------------------------------------|
| prefix-cache hits    | blocks of ``block_size`` consecutive requests share one system prompt   |
| eviction + offload   | ``engine_config_for`` sizes the pool below the workload's working set  |
| load-back            | the blocks cycle through the system prompts, so a prompt comes back     |
|                      | after the other blocks pushed it to the host tier                       |
| chunked prefill      | every ``long_every``-th request has a user part longer than the chunk   |
| aborts               | every ``abort_every``-th request is aborted halfway through its output  |
| staggered arrivals   | ``arrivals_per_step`` requests join per driver step                     |

``load_prompts(path)`` reads a JSONL file instead, one ``{"prompt_ids": [...], "max_new_tokens": N}``
per line. ``kvcanary.runs.driver`` drives a workload through an engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvcanary.engine.config import EngineConfig
from kvcanary.errors import ConfigError

CHUNK_SIZE = 32  # the built-in engine's prefill chunk; long prompts exceed it several times
POOL_SLOTS = 640  # the built-in engine's pool: forces eviction, offload and load-back


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: joins at driver step ``arrival_step``; with ``abort_after`` > 0 it is aborted
    once it has produced that many tokens."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    abort_after: int = 0


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]
    vocab_size: int

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def max_request_len(self) -> int:
        """Longest prompt + max_new_tokens."""
        return max(len(r.prompt_ids) + r.max_new_tokens for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(len(r.prompt_ids) + r.max_new_tokens for r in self.requests)


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the built-in workload (see the module table). ``user_len``: range of the per-request
    part after the system prompt; ``long_len``: that part for long requests."""

    num_requests: int = 96
    max_new_tokens: int = 16
    seed: int = 0
    vocab_size: int = 256
    num_system_prompts: int = 3
    system_prompt_len: int = 40
    block_size: int = 6
    user_len: tuple[int, int] = (4, 20)
    long_every: int = 7
    long_len: int = 72
    abort_every: int = 9
    arrivals_per_step: int = 1

    def __post_init__(self):
        for name in ("num_requests", "max_new_tokens", "vocab_size", "num_system_prompts", "system_prompt_len",
                     "block_size", "long_len", "arrivals_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"WorkloadConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_every", "abort_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"WorkloadConfig.{name} must be >= 0 (0 = never), got {getattr(self, name)}")
        lo, hi = self.user_len
        if not 1 <= lo <= hi:
            raise ConfigError(f"WorkloadConfig.user_len must be (lo, hi) with 1 <= lo <= hi, got {self.user_len}")


def builtin_workload(config: WorkloadConfig = WorkloadConfig()) -> Workload:
    """The deterministic built-in workload of ``config`` (same seed, same requests)."""
    c = config
    gen = torch.Generator().manual_seed(c.seed)
    draw = lambda n: tuple(torch.randint(0, c.vocab_size, (n,), generator=gen).tolist())
    system = [draw(c.system_prompt_len) for _ in range(c.num_system_prompts)]
    requests = []
    for i in range(c.num_requests):
        is_long = c.long_every and i % c.long_every == c.long_every - 1
        n = c.long_len if is_long else int(torch.randint(c.user_len[0], c.user_len[1] + 1, (1,), generator=gen))
        prompt = system[(i // c.block_size) % c.num_system_prompts] + draw(n)
        is_aborted = c.abort_every and c.max_new_tokens > 1 and i % c.abort_every == c.abort_every - 1
        requests.append(WorkloadRequest(prompt, c.max_new_tokens, i // c.arrivals_per_step,
                                        c.max_new_tokens // 2 if is_aborted else 0))
    return Workload(tuple(requests), c.vocab_size)


def load_prompts(path: str | Path, vocab_size: int, arrivals_per_step: int = 1) -> Workload:
    """A workload from a JSONL file of ``{"prompt_ids": [int, ...], "max_new_tokens": int}`` lines
    (blank lines skipped), arriving ``arrivals_per_step`` per step, none aborted. Raises
    ConfigError naming the line for a malformed one."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg}); write one JSON object per line") from None
        ids, n = (obj.get("prompt_ids"), obj.get("max_new_tokens")) if isinstance(obj, dict) else (None, None)
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise ConfigError(f"{where}: prompt_ids must be a non-empty list of ints in [0, {vocab_size}), "
                              f"got {str(ids)[:60]}")
        if type(n) is not int or n < 1:
            raise ConfigError(f"{where}: max_new_tokens must be an int >= 1, got {n!r}")
        requests.append(WorkloadRequest(tuple(ids), n, len(requests) // arrivals_per_step))
    if not requests:
        raise ConfigError(f"{path} holds no requests; write one JSON object per line")
    return Workload(tuple(requests), vocab_size)


def engine_config_for(workload: Workload, device: str = "cpu", **overrides) -> EngineConfig:
    """An engine config for ``workload``: a pool of ``POOL_SLOTS`` slots (more when one request
    needs it), small next to what 16 running requests and the cached system prompts ask for, so
    the prefix cache evicts to a host tier of the same size and system prompts come back from it;
    prefill chunks of ``CHUNK_SIZE``. ``overrides`` replace any field."""
    longest = workload.max_request_len
    num_slots = -(-max(POOL_SLOTS, 2 * longest + 64) // 64) * 64
    base = EngineConfig(num_slots=num_slots, max_rows=33, max_ctx=-(-longest // 64) * 64, chunk_size=CHUNK_SIZE,
                        max_tokens_per_step=192, max_running=16, host_tier_slots=num_slots, device=device)
    return replace(base, **overrides)
