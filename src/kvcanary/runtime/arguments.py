"""The checks of the Canary's public arguments that the ops below do not see: a step number, a
launch point, a list of sweep runs and its budget, slots and positions handed in by an engine.
Each raises InputTypeError / InputError naming the argument, the expected and the actual value,
before anything is written."""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.core.record import LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.runtime.sweep import SweepRun

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def check_int(name: str, value, lo: int = 0, hi: int = 2**62) -> int:
    """An int (bools and floats refused) in [lo, hi)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value < hi:
        raise InputError(f"{name} {value} out of range [{lo}, {hi})")
    return value


def check_point(point) -> LaunchPoint:
    if not isinstance(point, LaunchPoint):
        raise InputTypeError(f"point must be a LaunchPoint (HEAD, TAIL or SWEEP), got {point!r}")
    return point


def outside(t: torch.Tensor, n: int) -> bool:
    """Whether an integer of ``t`` (one of the signed integer dtypes) lies outside [0, n). On the
    host, for 64- and 32-bit words, one reduction of the words as unsigned: a negative one wraps
    above any n they can address. On a device: one reduction (the least and the largest), one
    small copy."""
    if not t.numel():
        return False
    if t.device.type != "cpu":
        lo, hi = torch.stack(torch.aminmax(t)).tolist()
        return lo < 0 or hi >= n
    v = t.numpy()
    if v.itemsize == 8:
        return int(v.view(np.uint64).max()) >= n
    if v.itemsize == 4 and n <= 1 << 31:
        return int(v.view(np.uint32).max()) >= n
    return int(v.min()) < 0 or int(v.max()) >= n


def check_slots(name: str, slots, num_slots: int | None = None, flat: bool = True,
                on_device: bool = False) -> torch.Tensor:
    """A tensor of signed integer slots, 1-D where ``flat``; each in [0, num_slots) where given:
    on the host, and on a device too where ``on_device`` (one reduction and one small copy to
    the host: for slots a gather is about to read, where a slot outside the pool would stop the
    device and a negative one would index from the end)."""
    if not isinstance(slots, torch.Tensor) or slots.dtype not in _INT_DTYPES:
        got = f"a {str(slots.dtype).removeprefix('torch.')} tensor" if isinstance(slots, torch.Tensor) else \
            type(slots).__name__
        raise InputTypeError(f"{name} must be a tensor of signed integer slots (int64, int32, int16 or int8), "
                             f"got {got}")
    if flat and slots.dim() != 1:
        raise InputError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    if num_slots is None or (slots.device.type != "cpu" and not on_device) or not outside(slots, num_slots):
        return slots
    flat_slots = slots.reshape(-1)
    i = int(torch.nonzero((flat_slots < 0) | (flat_slots >= num_slots))[0])
    raise InputError(f"{name}[{i}] = {int(flat_slots[i])} out of range [0, {num_slots}) (this pool's slots)")


def check_runs(runs, budget_bytes) -> None:
    """A sweep's runs (a list or tuple of SweepRun) and its byte budget (None or an int >= 0)."""
    if not isinstance(runs, list | tuple):
        raise InputTypeError(f"runs must be a list of SweepRun, got {type(runs).__name__}")
    for i, run in enumerate(runs):
        if not isinstance(run, SweepRun):
            raise InputTypeError(f"runs[{i}] must be a SweepRun, got {type(run).__name__}")
    if budget_bytes is not None:
        check_int("budget_bytes", budget_bytes)
