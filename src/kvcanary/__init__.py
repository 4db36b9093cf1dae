"""kv-canary: make KV-cache corruption in LLM inference engines loud.

The public API is this package and ``kvcanary.ops``; deeper module paths are internal::

    from kvcanary import Canary, CanaryConfig, ForwardBatch, KVSource, PoolGeometry

Names load on first use, so ``import kvcanary`` alone imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Canary": "kvcanary.runtime.canary",
    "CanaryConfig": "kvcanary.config",
    "CanaryViolation": "kvcanary.errors",
    "FingerprintMode": "kvcanary.core.record",
    "ForwardBatch": "kvcanary.runtime.batch",
    "Half": "kvcanary.core.record",
    "HostMirror": "kvcanary.runtime.rows",
    "Incident": "kvcanary.runtime.incidents",
    "KVSource": "kvcanary.ops.sources",
    "LaunchPoint": "kvcanary.core.record",
    "LayoutSignature": "kvcanary.runtime.signature",
    "Overlap": "kvcanary.config",
    "Policy": "kvcanary.config",
    "PoolGeometry": "kvcanary.runtime.canary",
    "PoolKind": "kvcanary.core.record",
    "Reason": "kvcanary.core.record",
    "Recovery": "kvcanary.runtime.policy",
    "StepReport": "kvcanary.runtime.step_end",
    "SweepRun": "kvcanary.runtime.sweep",
    "Violation": "kvcanary.runtime.reporting",
}

__all__ = [
    "Canary",
    "CanaryConfig",
    "CanaryViolation",
    "FingerprintMode",
    "ForwardBatch",
    "Half",
    "HostMirror",
    "Incident",
    "KVSource",
    "LaunchPoint",
    "LayoutSignature",
    "Overlap",
    "Policy",
    "PoolGeometry",
    "PoolKind",
    "Reason",
    "Recovery",
    "StepReport",
    "SweepRun",
    "Violation",
    "__version__",
]

if TYPE_CHECKING:
    from kvcanary.config import CanaryConfig, Overlap, Policy
    from kvcanary.core.record import FingerprintMode, Half, LaunchPoint, PoolKind, Reason
    from kvcanary.errors import CanaryViolation
    from kvcanary.ops.sources import KVSource
    from kvcanary.runtime.batch import ForwardBatch
    from kvcanary.runtime.canary import Canary, PoolGeometry
    from kvcanary.runtime.incidents import Incident
    from kvcanary.runtime.policy import Recovery
    from kvcanary.runtime.reporting import Violation
    from kvcanary.runtime.rows import HostMirror
    from kvcanary.runtime.signature import LayoutSignature
    from kvcanary.runtime.step_end import StepReport
    from kvcanary.runtime.sweep import SweepRun


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcanary' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
