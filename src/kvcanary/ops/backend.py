"""The ops' dispatch, public for the layers above (runtime, bench): which backend an op runs on
(``Backend``), whether Triton is importable here (``HAS_TRITON``), and ``triton`` / ``tl`` for
kernels written outside ``ops`` (a stub ``triton.jit`` where Triton is absent)."""

from __future__ import annotations

from kvcanary.ops._common import HAS_TRITON, Backend, cdiv, tl, triton, use_triton

__all__ = ["HAS_TRITON", "Backend", "cdiv", "tl", "triton", "use_triton"]
