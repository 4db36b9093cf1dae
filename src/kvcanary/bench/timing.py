"""Timing and bandwidth floors shared by the benchmarks.

On CUDA every figure is a median over batches of CUDA-graph replays, timed with CUDA events
around each batch; on the CPU (no graphs) eager calls are timed with ``time.perf_counter``. A
floor is the bytes a piece of work must move over the copy bandwidth measured in the same run
(a large device-to-device ``copy_``; bytes read + written over the time), so floors and timings
share one machine state.

| quantity            | formula                                         | unit        |
|---------------------|-------------------------------------------------|-------------|
| copy bandwidth      | 2 * copy_bytes / copy time                      | GB/s (1e9)  |
| floor of n bytes    | n / copy bandwidth                              | µs          |
"""

from __future__ import annotations

import platform
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

PER_CALL_MS = 1.0  # a timed batch of replays lasts at least this long (launch jitter << batch time)


class CaptureError(RuntimeError):
    """A CUDA-graph capture failed; ``op`` names the innermost kvcanary frame that broke it."""

    def __init__(self, what: str, op: str, cause: BaseException):
        super().__init__(f"CUDA-graph capture of {what} failed in {op}: {cause!r}")
        self.what, self.op, self.cause = what, op, cause


@dataclass(frozen=True)
class Timing:
    """Median µs of one call of the timed work; ``mode`` says how it was timed."""

    us: float
    mode: str
    reps: int
    batches: int
    capture_error: str | None = None

    def as_dict(self) -> dict:
        return {"us": self.us, "mode": self.mode, "reps": self.reps, "batches": self.batches,
                "capture_error": self.capture_error}


def floor_us(nbytes: float, copy_GBps: float) -> float:
    """Bandwidth floor of moving ``nbytes`` at the measured copy bandwidth (GB/s, read + written)."""
    if copy_GBps <= 0:
        raise ValueError(f"copy_GBps must be > 0, got {copy_GBps}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return nbytes / copy_GBps / 1e3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_us(fn: Callable[[], object], device: torch.device, reps: int, batches: int) -> float:
    """Median over ``batches`` of the mean µs per call in a batch of ``reps`` back-to-back calls."""
    if reps < 1 or batches < 1:
        raise ValueError(f"reps and batches must be >= 1, got reps={reps}, batches={batches}")
    if device.type != "cuda":
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / reps)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(batches)]
    for start, end in events:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / reps


def run_all(fns: Sequence[Callable[[], object]]) -> None:
    for f in fns:
        f()


def culprit(exc: BaseException) -> str:
    """The innermost kvcanary frames (outside ``kvcanary.bench``) of an exception's traceback,
    innermost first: ``kvcanary.ops.stamp.stamp (stamp.py:230) <- kvcanary.runtime.canary.head (...)``."""
    frames = []
    for f in traceback.extract_tb(exc.__traceback__):
        parts = Path(f.filename).with_suffix("").parts
        if "kvcanary" not in parts:
            continue
        module = ".".join(parts[len(parts) - 1 - parts[::-1].index("kvcanary"):])
        if not module.startswith("kvcanary.bench"):
            frames.append(f"{module}.{f.name} ({Path(f.filename).name}:{f.lineno})")
    return " <- ".join(frames[::-1][:3]) if frames else "no kvcanary frame (the capture broke outside the package)"


def capture(fns: Sequence[Callable[[], object]], what: str) -> torch.cuda.CUDAGraph:
    """One CUDA graph that launches every function once, after a warm-up on a side stream
    (compiles kernels, settles the allocator). Raises CaptureError naming the op that broke it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_all(fns)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run_all(fns)
    except Exception as e:  # noqa: BLE001 - reported with the op that broke the capture
        cause = e.__context__ if e.__context__ is not None and not culprit(e).startswith("kvcanary") else e
        raise CaptureError(what, culprit(cause), e) from e
    return graph


def graph_us(fns: Sequence[Callable[[], object]], reps: int = 20, batches: int = 30) -> float:
    """Median µs per function: one graph launches every function once; batches of ``reps`` replays."""
    graph = capture(fns, f"{len(fns)} functions")
    return median_us(graph.replay, torch.device("cuda"), reps, batches) / len(fns)


def eager_us(fns: Sequence[Callable[[], object]], device: torch.device, batches: int = 10) -> float:
    """Median µs per function launched eagerly, in batches of up to 8 calls (fewer when one call
    outlasts ``PER_CALL_MS``; 5 batches when one call takes over 50 ms)."""
    call = partial(run_all, fns)
    call()
    one = median_us(call, device, 1, 1)
    reps = max(1, min(8 // len(fns), int(PER_CALL_MS * 1e3 / max(one, 1e-3))))
    return median_us(call, device, reps, batches if one < 50e3 else min(batches, 5)) / len(fns)


def time_step(fns: Sequence[Callable[[], object]], device: torch.device, what: str, batches: int = 15,
              graph: bool = True) -> Timing:
    """Median µs of running ``fns`` once, in order: in one CUDA graph on CUDA (eager with CUDA
    events when the capture fails, with the failing op in ``capture_error``); eager with
    ``perf_counter`` on the CPU. Batches hold enough calls to last about ``PER_CALL_MS``."""
    error = None
    if device.type == "cuda" and graph:
        try:
            g = capture(fns, what)
            call, mode = g.replay, "cuda-graph replay, cuda events"
        except CaptureError as e:
            error, call, mode = str(e), partial(run_all, fns), "eager, cuda events (capture failed)"
    else:
        call = partial(run_all, fns)
        mode = "eager, cuda events" if device.type == "cuda" else "eager, perf_counter (no CUDA graphs on the CPU)"
    call()
    one = median_us(call, device, 1, 3)
    reps = max(1, min(20, int(PER_CALL_MS * 1e3 / max(one, 1e-3))))
    return Timing(median_us(call, device, reps, batches), mode, reps, batches, error)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s (read + written) of a ``copy_`` of ``nbytes`` between two buffers of ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(7)
    dst.copy_(src)
    us = median_us(partial(dst.copy_, src), device, 2, 10)
    return 2 * nbytes / us / 1e3


def environment(device: torch.device) -> dict:
    """Device name and versions, for the JSON of every benchmark."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - platforms without triton wheels
        triton_version = None
    env = {"device": device.type, "torch": torch.__version__, "triton": triton_version,
           "python": platform.python_version(), "host": platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   device_memory_GiB=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count)
    else:
        env.update(device_name=f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                               "torch threads)")
    return env
