"""The ops' dispatch, public for the layers above (runtime, bench): which backend an op runs on
(``Backend``), whether Triton is importable here (``HAS_TRITON``), whether the compiled CPU
kernels serve here (``cpu_kernels_usable``; ``compile_cpu_kernels`` loads them: numba,
``Backend.NUMBA``; ``BoundForward`` and ``batch_arrays``: their per-step calls for a CPU Canary),
and ``triton`` / ``tl`` for kernels written outside ``ops`` (a stub ``triton.jit`` where Triton is
absent)."""

from __future__ import annotations

from kvcanary.ops._common import HAS_TRITON, Backend, cdiv, tl, triton, use_triton
from kvcanary.ops._cpu import BoundForward, batch_arrays
from kvcanary.ops._cpu import compile_kernels as compile_cpu_kernels
from kvcanary.ops._cpu import usable as cpu_kernels_usable

__all__ = ["HAS_TRITON", "Backend", "BoundForward", "batch_arrays", "cdiv", "compile_cpu_kernels",
           "cpu_kernels_usable", "tl", "triton", "use_triton"]
