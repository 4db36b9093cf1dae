"""Frozen configuration of the canary runtime, validated on construction.

Configuration is built at the edge (CLI, server, tests) and passed down frozen; nothing below
this module reads the environment. Engine configs live in ``kvcanary.engine.config``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcanary.core.record import MAX_SOURCES, FingerprintMode, Half
from kvcanary.errors import ConfigError


class Overlap(enum.Enum):
    """Where a canary on CUDA (fused kernel) runs what need not be ordered with the model."""

    OFF = "off"  # HEAD and TAIL on the current stream, always
    CAPTURED = "captured"  # the side stream inside a CUDA-graph capture; eager forwards on the current stream
    ALWAYS = "always"  # the side stream for eager forwards too


class Policy(enum.Enum):
    """What happens when a violation is reported."""

    OFF = "off"  # no checks at all
    LOG = "log"  # structured line + metrics, keep serving
    RAISE = "raise"  # CanaryViolation after the step
    RECOMPUTE = "recompute"  # hand the engine the affected requests and slots


@dataclass(frozen=True)
class CanaryConfig:
    """``policy``: see Policy. ``real_kv``: fingerprint mode of the covered ``layers`` x ``halves``
    (``layers=None``: the first and last layer; at most 4 sources in all). ``sweep_interval``:
    steps between sweeps of idle prefix-cache slots (0 = never); ``sweep_budget_bytes``: bytes one
    sweep may read. ``ring_capacity``: violation rows kept between reads. ``plan_capacity``: verify
    entries per forward (more disables that forward's verify and is counted; the fused CUDA path
    has no such limit). ``max_bs``: requests per forward; ``max_tokens``: tokens one forward
    writes. ``stats_period``: steps between stats lines (0 = never). ``truth``: check the tokens
    of every forward (written and read) against the requests' token history; sweeps check idle
    cached slots against the tokens the engine passes with them (its prefix-cache keys) either way.
    ``watchdog_window``: steps a launch point may stay silent (0 = derived from the sweep interval).
    ``incident_summary_steps``: steps between incident summary lines (WARNING; re-detections of
    open incidents are counted there, not logged one by one; a line only when something changed;
    0 = only at ``flush``).
    ``fused``: HEAD and TAIL as one ``check_forward`` launch each (None: the Triton kernel on CUDA,
    the compiled CPU kernel on the CPU where numba serves; True on the CPU runs the Triton kernel
    there, which needs TRITON_INTERPRET=1 and is for tests; False: the ops one by one).
    ``overlap`` (an ``Overlap``; True means ALWAYS, False OFF): on CUDA with the fused kernel, run
    what need not be ordered with the model on a side stream (HEAD's checks and stamps; TAIL, from
    ``Canary.start_tail``), joined by ``Canary.tail``; HEAD's write marks stay ahead of the
    forward. CAPTURED (the default) does so inside CUDA-graph captures only: an eager forward runs
    HEAD and TAIL on the current stream, one launch each, where the side stream costs four more
    host calls a forward (two forks, the marks' own launch, a join) to hide device time that an
    eager step, whose host launches the model's kernels one by one, rarely has to hide. ALWAYS
    forks eager forwards too (an eager engine whose forwards are device-bound); OFF never.
    ``eager_graphs``: on CUDA with the fused kernel, run an eager forward's HEAD and TAIL (on the
    current stream: not under ALWAYS, nor for a sliding-window pool) as replays of graphs captured
    once per bucket of batch sizes (``runtime.eager_graphs``): less host work a forward, for a copy
    of the batch into fixed buffers and more device work where a bucket pads the batch. On the
    CPU with ``fused=True`` (the interpreter, for tests) the same buckets are launched, not
    replayed; elsewhere it does nothing."""

    policy: Policy = Policy.LOG
    real_kv: FingerprintMode = FingerprintMode.PARTIAL
    layers: tuple[int, ...] | None = None
    halves: tuple[Half, ...] = (Half.K, Half.V)
    sweep_interval: int = 8
    sweep_budget_bytes: int = 1 << 20
    ring_capacity: int = 4096
    plan_capacity: int = 1 << 16
    max_bs: int = 1024
    max_tokens: int = 1 << 20
    fused: bool | None = None
    overlap: Overlap = Overlap.CAPTURED
    stats_period: int = 0
    truth: bool = True
    watchdog_window: int = 0
    incident_summary_steps: int = 100
    eager_graphs: bool = False

    def __post_init__(self):
        if type(self.overlap) is bool:  # the flag this option was before it had three values
            object.__setattr__(self, "overlap", Overlap.ALWAYS if self.overlap else Overlap.OFF)
        if not isinstance(self.overlap, Overlap):
            raise ConfigError(f"CanaryConfig.overlap must be an Overlap (or a bool), got {self.overlap!r}")
        if type(self.eager_graphs) is not bool:
            raise ConfigError(f"CanaryConfig.eager_graphs must be True or False, got {self.eager_graphs!r}")
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"CanaryConfig.policy must be a Policy, got {self.policy!r}")
        # whether the canary runs (a policy other than OFF): a plain attribute, not a property, since
        # every canary call a step reads it, where each Python call costs µs between a model's launches
        object.__setattr__(self, "enabled", self.policy is not Policy.OFF)
        if not isinstance(self.real_kv, FingerprintMode):
            raise ConfigError(f"CanaryConfig.real_kv must be a FingerprintMode, got {self.real_kv!r}")
        if not self.halves or any(not isinstance(h, Half) for h in self.halves):
            raise ConfigError(f"CanaryConfig.halves must be a non-empty tuple of Half, got {self.halves!r}")
        n_layers = 2 if self.layers is None else len(self.layers)
        if self.real_kv is not FingerprintMode.NONE and n_layers * len(self.halves) > MAX_SOURCES:
            raise ConfigError(f"CanaryConfig covers {n_layers} layers x {len(self.halves)} halves > {MAX_SOURCES} "
                              "KV sources; cover fewer layers")
        for name in ("sweep_interval", "sweep_budget_bytes", "stats_period", "watchdog_window",
                     "incident_summary_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"CanaryConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("ring_capacity", "plan_capacity", "max_bs", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CanaryConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def watchdog_steps(self) -> int:
        """Steps without a HEAD/TAIL launch (or two sweep intervals without a sweep) before it fires."""
        return self.watchdog_window or max(4, 2 * self.sweep_interval + 2)
