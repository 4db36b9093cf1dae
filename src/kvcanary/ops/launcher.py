"""Launch a Triton kernel without Triton's per-call argument binding, where that is safe.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument in Python on every
launch, then builds launch metadata and checks each pointer with the driver: 45 µs for the fused
check's 57 arguments on an H200 in a loop, about twice that between a model's launches, where a
decode step has a few µs to spare. ``launch`` does the same launch keyed by exactly what Triton's
specialisation of these arguments depends on:

| argument              | part of the key                                                     |
|-----------------------|---------------------------------------------------------------------|
| tensor                | its dtype and whether its address is a multiple of 16                |
| int (not a bool)      | its width class (int32, int64, uint64); where the kernel specialises |
|                       | it (not in ``do_not_specialize``), also == 1 and % 16 == 0           |
| bool                  | its value                                                            |
| constexprs, options   | their values, and the current device                                 |

A kernel launched many times with the same leading arguments (a bound check's state buffers)
keys them once: ``launch(..., fixed=Fixed(fn, leading))`` keys only the arguments that follow,
after one address read per fixed tensor (one that moved is keyed again).

The first launch of a key goes through Triton (compiling when it must) and the compiled kernel
it returns is kept; later launches call that kernel's launcher directly, tensors passed as their
addresses (the ops validated their devices). Triton's own launch serves instead under the
interpreter (``TRITON_INTERPRET=1``), while launch hooks or pre-run hooks are installed (a
profiler), for an argument of another type, and where the kernel Triton returns lacks the
launcher this module calls (then nothing is kept; the arguments are the same either way).
"""

from __future__ import annotations

import os

import torch

from kvcanary.ops._common import HAS_TRITON

_I32 = (-(1 << 31), (1 << 31) - 1)


class _Kernel:
    """What ``launch`` keeps per @triton.jit function: which parameters it specialises, the
    names of its trailing constexprs, and the compiled kernels by key."""

    def __init__(self, fn):
        params = fn.params
        self.fn = fn
        self.specialised = frozenset(i for i, p in enumerate(params) if not p.is_constexpr and not p.do_not_specialize)
        first = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        self.num_args = first
        self.constexprs = tuple(p.name for p in params[first:])
        # the fast path passes positional arguments then constexprs in signature order
        self.usable = all(p.is_constexpr for p in params[first:])
        self.compiled: dict = {}


_kernels: dict[int, _Kernel] = {}
_state: dict[str, object] = {}


def _driver():
    """(current device, current stream, launch-hook knobs) of this Triton, or None where the
    fast path cannot serve."""
    if "driver" not in _state:
        _state["driver"] = None
        if HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available():
            try:
                from triton import knobs
                from triton.runtime import driver

                active = driver.active
                _state["driver"] = (active.get_current_device, active.get_current_stream, knobs.runtime)
            except (ImportError, AttributeError, RuntimeError):
                pass
    return _state["driver"]


def _hooked(runtime) -> bool:
    """Whether a launch hook is installed (HookChain in Triton >= 3.6, a callable or None before)."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Fixed:
    """``args``, the first arguments of every ``launch`` of ``fn`` that passes this as ``fixed``,
    keyed once: tensors (kept alive here; each launch compares their addresses, one read each,
    and keys them again where one moved) and ints that never change."""

    __slots__ = ("args", "key", "values", "tensors", "addresses")

    def __init__(self, fn, args: tuple):
        self.args = tuple(args)
        self.tensors = tuple(a for a in self.args if isinstance(a, torch.Tensor))
        self.key, self.values, self.addresses = None, [], []  # no key: Triton's own launch (no fast path
        if _driver() is not None:  # here, or an argument of a type it does not take)
            self.rekey(_kernel(fn))

    def rekey(self, k: _Kernel) -> None:
        self.key, self.values = _key(k, self.args)
        self.addresses = [t.data_ptr() for t in self.tensors]

    def moved(self) -> bool:
        """Whether a tensor's storage moved since it was keyed (an in-place resize): the launch keys
        the arguments again rather than pass a stale address."""
        return [t.data_ptr() for t in self.tensors] != self.addresses


def _kernel(fn) -> _Kernel:
    k = _kernels.get(id(fn))
    if k is None or k.fn is not fn:
        k = _kernels[id(fn)] = _Kernel(fn)
    return k


def launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, fixed: Fixed | None = None) -> None:
    """``fn[grid](*args, **constexprs, num_warps=num_warps)``, through the kept compiled kernel
    when one matches (module doc). ``constexprs`` must name every constexpr of ``fn``. With
    ``fixed`` (a ``Fixed``), ``args`` are the arguments after its own."""
    drv = _driver()
    if drv is None:
        fn[grid](*(fixed.args + args if fixed is not None else args), **constexprs, num_warps=num_warps)
        return
    k = _kernel(fn)
    get_device, get_stream, runtime = drv
    key, values = None, None
    first = len(fixed.args) if fixed is not None else 0
    if (k.usable and first + len(args) == k.num_args and len(constexprs) == len(k.constexprs)
            and (fixed is None or fixed.key is not None)
            and not getattr(fn, "pre_run_hooks", None) and not _hooked(runtime)):
        key, values = _key(k, args, first)
        if key is not None and fixed is not None:
            if fixed.moved():
                fixed.rekey(k)
            key, values = fixed.key + key, fixed.values + values
    if key is None:  # Triton's own launch (module doc)
        fn[grid](*(fixed.args + args if fixed is not None else args), **constexprs, num_warps=num_warps)
        return
    device = get_device()
    key = (device, num_warps, tuple(constexprs[name] for name in k.constexprs), *key)
    kernel = k.compiled.get(key)
    if kernel is None:
        kernel = fn[grid](*(fixed.args + args if fixed is not None else args), **constexprs, num_warps=num_warps)
        if kernel is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "run"):
            k.compiled[key] = kernel
        return
    g = (*grid, 1, 1)
    kernel.run(g[0], g[1], g[2], get_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
               *values, *key[2])


def _key(k: _Kernel, args: tuple, first: int = 0) -> tuple[tuple | None, list]:
    """(the arguments' part of the key, the values to launch with), or (None, _) for an argument
    of a type the fast path does not take; ``args`` are the kernel's from argument ``first`` on."""
    key, values = [], []
    lo, hi = _I32
    for i, a in enumerate(args, first):
        t = type(a)
        if t is torch.Tensor or isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            key.append((a.dtype, ptr & 15 == 0))
            values.append(ptr)
        elif t is int:
            width = 0 if lo <= a <= hi else 1 if a < 1 << 63 else 2
            key.append((width, a == 1, a & 15 == 0) if i in k.specialised else width)
            values.append(a)
        elif t is bool:
            key.append(a)
            values.append(a)
        else:
            return None, values
    return tuple(key), values
