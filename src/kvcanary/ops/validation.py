"""The ops' input checks, public for benchmarks and the layers above: ``check_tensor`` (dtype,
rank, contiguity, device), ``check_same_device`` and ``validate_ring`` (a DeviceState's per-call
check, the launch tag and, for host tensors, the ring counter's value)."""

from __future__ import annotations

from kvcanary.ops._common import check_same_device, check_tensor
from kvcanary.ops._ring import validate_ring

__all__ = ["check_same_device", "check_tensor", "validate_ring"]
