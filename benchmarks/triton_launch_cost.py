"""Host cost of one Triton launch of the canary's kernels, and of its parts (CUDA).

Records the arguments of the first eager launch of each kernel in a run of the `bench_engine.py`
workload, then launches it again in a tight loop (the device synchronised before and after each
set; medians of 300 launches) four ways: through `JITFunction.run` (what the ops do); the binder
alone (Triton's argument binding and specialisation); the compiled kernel's launcher with the bound
arguments; the same with every tensor passed as its address (no per-pointer driver query). The
difference between the first and the third is what a launch that skips the binding would save;
between the third and the fourth, what passing bound buffers as addresses would. The last column
is `kvcanary.ops.launcher.launch`, the ops' direct launch of a kept kernel (its key, then the
launcher with every tensor as its address).

    PYTHONPATH=src python3 benchmarks/triton_launch_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as be  # noqa: E402

KERNELS = ("_check_kernel", "_scatter_kernel", "_mark_kernel", "_verify_kernel")


def _median_us(f, n: int = 300) -> float:
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("triton_launch_cost.py needs CUDA")
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kvcanary.ops.launcher import launch

    seen = {}
    run = JITFunction.run

    def recording(self, *a, grid, warmup, **k):
        kernel = run(self, *a, grid=grid, warmup=warmup, **k)
        if not torch.cuda.is_current_stream_capturing():
            seen.setdefault(self.fn.__name__, (self, a, dict(k), grid, kernel))
        return kernel

    JITFunction.run = recording
    be.run_once("partial", "cuda", be.workload(512, 48), 32, be.engine_options(True))
    JITFunction.run = run
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    print(f"{'kernel':<18}{'args':>5}{'JITFunction.run':>16}{'binder':>8}{'launcher':>9}{'addresses':>10}"
          f"{'ops launch':>12}   (µs)")
    for name in KERNELS:
        if name not in seen:
            continue
        fn, a, k, grid, kernel = seen[name]
        binder = fn.device_caches[dev][4]
        bound = tuple(binder(*a, **k)[0].values())
        g = (*grid, 1, 1)

        def direct(values=bound, kernel=kernel, g=g):
            kernel.run(g[0], g[1], g[2], driver.active.get_current_stream(dev), kernel.function,
                       kernel.packed_metadata, None, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                       *values)

        addresses = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound)
        jit = _median_us(lambda fn=fn, grid=grid, a=a, k=k: fn[grid](*a, **k))
        bind = _median_us(lambda binder=binder, a=a, k=k: binder(*a, **k))
        launcher = _median_us(direct)
        by_address = _median_us(lambda direct=direct, addresses=addresses: direct(addresses))
        cx, warps = {n: v for n, v in k.items() if n != "num_warps"}, k.get("num_warps", 4)
        ops = _median_us(lambda fn=fn, grid=grid, a=a, cx=cx, w=warps: launch(fn, grid, a, cx, w))
        print(f"{name:<18}{len(bound):>5}{jit:16.1f}{bind:8.1f}{launcher:9.1f}{by_address:10.1f}{ops:12.1f}")


if __name__ == "__main__":
    main()
