"""What a plain host call costs between the reference engine's launches, against the same call in
a tight loop (CUDA, graph-captured decode, canary off).

    PYTHONPATH=src python3 benchmarks/engine_cold_calls.py

Runs the ``bench_engine.py`` workload (96 requests x 32 new tokens) three times with hooks that
do, after every forward (``after_forward``, where the canary's ``end_step`` runs): a one-element
``fill_``, a 2048-word pinned-to-device copy, an event record, a Triton launch of a one-program
kernel through Triton's own launch, ``torch.cuda.current_stream()`` and a small Python sum,
each timed; then the same calls 200 times in a loop. It also counts the forwards after which the
stream was still busy (the host ahead of the device). Prints the medians of the last run's calls
beside the loop's.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as be  # noqa: E402
from kvcanary.engine.config import EngineConfig, ModelConfig  # noqa: E402
from kvcanary.engine.engine import Engine  # noqa: E402
from kvcanary.engine.hooks import EngineHooks  # noqa: E402


@triton.jit
def _one(x_ptr, n):
    pid = tl.program_id(0)
    if pid < n:
        tl.store(x_ptr + pid, pid)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("engine_cold_calls.py needs CUDA (graph-captured decode)")
    x = torch.zeros(8, dtype=torch.int32, device="cuda")
    pinned = torch.zeros(2048, dtype=torch.int32, pin_memory=True)
    landing = torch.zeros(2048, dtype=torch.int32, device="cuda")
    event = torch.cuda.Event()
    _one[(1,)](x, 1)
    torch.cuda.synchronize()

    def calls() -> dict[str, float]:
        out = {}
        t = time.perf_counter()
        x.fill_(1)
        out["fill_"] = time.perf_counter() - t
        t = time.perf_counter()
        landing.copy_(pinned, non_blocking=True)
        out["h2d copy_"] = time.perf_counter() - t
        t = time.perf_counter()
        event.record()
        out["event.record"] = time.perf_counter() - t
        t = time.perf_counter()
        _one[(1,)](x, 1)
        out["triton launch"] = time.perf_counter() - t
        t = time.perf_counter()
        torch.cuda.current_stream()
        out["current_stream"] = time.perf_counter() - t
        t = time.perf_counter()
        sum(range(50))
        out["sum(range(50))"] = time.perf_counter() - t
        return out

    acc: dict[str, list[float]] = collections.defaultdict(list)
    busy: list[bool] = []

    class Hooks(EngineHooks):
        def after_forward(self, batch):
            busy.append(not torch.cuda.current_stream().query())
            for name, dt in calls().items():
                acc[name].append(dt)

    mc = ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                     intermediate=768)
    ec = EngineConfig(num_slots=2400, max_rows=33, max_ctx=256, host_tier_slots=600, max_running=24, device="cuda",
                      **be.engine_options(True))
    prompts = be.workload(512, 96)
    for i in range(3):
        acc.clear()
        busy.clear()
        engine = Engine(mc, ec, Hooks())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, 32)
        torch.cuda.synchronize()
        print(f"run {i}: {time.perf_counter() - t0:.3f} s, {engine.stats.num_steps} steps")
    print(f"stream busy after the forward: {sum(busy)} of {len(busy)} forwards (last run)")
    loop: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(200):
        for name, dt in calls().items():
            loop[name].append(dt)
    torch.cuda.synchronize()
    print(f"{'call':<18}{'in the engine, median us':>26}{'p90':>8}{'loop, median us':>18}")
    for name, ts in acc.items():
        s = sorted(ts)
        print(f"{name:<18}{statistics.median(s) * 1e6:26.1f}{s[int(0.9 * len(s))] * 1e6:8.1f}"
              f"{statistics.median(loop[name]) * 1e6:18.1f}")


if __name__ == "__main__":
    main()
