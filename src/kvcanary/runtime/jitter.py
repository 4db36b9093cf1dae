"""Timing jitter: seeded random spin-waits at fixed points of a (captured) step, to widen race
windows between the forward, the canary's launches and copies on other streams.

    jitter = Jitter(seed=7, max_ns=20_000, points=3, device="cuda")
    jitter.draw()      # before each step or graph replay: new durations, on the device
    jitter.spin(0)     # inside the step (captured once, replayed): wait durations[0] ns

Durations come from a seeded host generator, one row per step, so a run is reproducible; they
reach the device through a pinned buffer and a non-blocking copy, which a graph replay reads
in place. The spin kernel reads the GPU's global timer; on the CPU there is nothing to widen
(the ops run one by one on one thread) and ``spin`` does nothing.
"""

from __future__ import annotations

import torch

from kvcanary.errors import ConfigError
from kvcanary.ops.backend import HAS_TRITON, tl, triton


@triton.jit
def _spin_kernel(durations_ptr, index):
    """Busy-wait ``durations[index]`` nanoseconds on the global timer."""
    wait = tl.load(durations_ptr + index)
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    now = start
    while now - start < wait:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)


class Jitter:
    def __init__(self, seed: int, max_ns: int, points: int, device: torch.device | str = "cuda"):
        if max_ns < 0:
            raise ConfigError(f"jitter max_ns must be >= 0, got {max_ns}")
        if points < 1:
            raise ConfigError(f"jitter points must be >= 1, got {points}")
        self.max_ns, self.points = max_ns, points
        self.device = torch.device(device)
        self.active = self.device.type == "cuda" and HAS_TRITON and max_ns > 0
        self.generator = torch.Generator().manual_seed(seed)
        self.host = torch.zeros(points, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.durations = torch.zeros(points, dtype=torch.int64, device=self.device)
        self.draws = 0

    def draw(self) -> torch.Tensor:
        """New durations for the next step (ns, one per point); returns them (host copy)."""
        torch.randint(0, self.max_ns + 1, (self.points,), generator=self.generator, out=self.host)
        self.durations.copy_(self.host, non_blocking=True)
        self.draws += 1
        return self.host.clone()

    def spin(self, point: int) -> None:
        """Wait this step's duration of ``point`` on the device (capturable; a no-op on the CPU)."""
        if not 0 <= point < self.points:
            raise ValueError(f"jitter point {point} outside [0, {self.points})")
        if self.active:
            _spin_kernel[(1,)](self.durations, point, num_warps=1)
