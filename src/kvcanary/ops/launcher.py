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

The first launch of a key goes through Triton (compiling when it must) and the compiled kernel
it returns is kept; later launches call that kernel's launcher directly, tensors passed as their
addresses (the ops validated their devices). Triton's own launch serves instead under the
interpreter (``TRITON_INTERPRET=1``), while launch hooks or pre-run hooks are installed (a
profiler), for an argument of another type, and where the kernel Triton returns lacks the
launcher this module calls (then nothing is kept; the arguments are the same either way).

``BoundLaunch`` does the same for a kernel launched again and again with most of its arguments
the same objects (a canary's own buffers): their part of the key is made once, and a call
examines only the arguments that change, with one address read per bound tensor to see that
none was moved (a moved one is keyed again).
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
        self.bound: dict = {}  # BoundLaunch's, keyed with the bound arguments' part as one tuple


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


def _kernel_of(fn) -> _Kernel:
    k = _kernels.get(id(fn))
    if k is None or k.fn is not fn:
        k = _kernels[id(fn)] = _Kernel(fn)
    return k


def launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, maxnreg: int | None = None) -> None:
    """``fn[grid](*args, **constexprs, num_warps=num_warps)``, through the kept compiled kernel
    when one matches (module doc). ``constexprs`` must name every constexpr of ``fn``.
    ``maxnreg``: a cap on registers a thread (Triton's option of that name; None: none)."""
    options = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
    drv = _driver()
    if drv is None:
        fn[grid](*args, **constexprs, **options)
        return
    k = _kernel_of(fn)
    get_device, get_stream, runtime = drv
    key, values = None, None
    if (k.usable and len(args) == k.num_args and len(constexprs) == len(k.constexprs)
            and not getattr(fn, "pre_run_hooks", None) and not _hooked(runtime)):
        key, values = _key(k, args)
    if key is None:  # Triton's own launch (module doc)
        fn[grid](*args, **constexprs, **options)
        return
    device = get_device()
    key = (device, num_warps, tuple(constexprs[name] for name in k.constexprs), maxnreg, *key)
    kernel = k.compiled.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **constexprs, **options)
        if kernel is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "run"):
            k.compiled[key] = kernel
        return
    _run(kernel, grid, get_stream(device), values, key[2])


def _run(kernel, grid: tuple, stream, values, constexprs: tuple) -> None:
    g = (*grid, 1, 1)
    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
               *values, *constexprs)


class BoundLaunch:
    """``launch(fn, grid, args, ...)`` where ``args`` holds the same objects at every position but
    ``dynamic`` (module doc). Build it with a whole argument tuple (any value at the dynamic
    positions); call it with the dynamic arguments, in position order."""

    def __init__(self, fn, args: tuple, dynamic: tuple[int, ...]):
        self.fn, self.dynamic = fn, tuple(dynamic)
        self.args = list(args)
        dyn = set(self.dynamic)
        self._fixed_at = tuple(i for i in range(len(args)) if i not in dyn)
        self._tensors = tuple(a for i, a in enumerate(args) if i not in dyn and isinstance(a, torch.Tensor))
        self._ptrs: tuple | None = None  # the bound tensors' addresses when their key part was made
        self._fixed_key: tuple = ()  # ... and that key part
        self._values: list | None = None  # every value to launch with; the dynamic ones replaced per call

    def __call__(self, grid: tuple, dynamic_args: tuple, constexprs: dict, num_warps: int = 4,
                 maxnreg: int | None = None) -> None:
        drv = _driver()
        k = _kernel_of(self.fn) if drv is not None else None
        if (k is None or not k.usable or len(self.args) != k.num_args or len(constexprs) != len(k.constexprs)
                or getattr(self.fn, "pre_run_hooks", None) or _hooked(drv[2])):
            launch(self.fn, grid, self._merged(dynamic_args), constexprs, num_warps, maxnreg)
            return
        ptrs = tuple(t.data_ptr() for t in self._tensors)
        if ptrs != self._ptrs:  # first call, or a bound tensor moved: key the bound arguments again
            fixed_key, fixed_values = _key(k, tuple(self.args[i] for i in self._fixed_at), self._fixed_at)
            if fixed_key is None:
                launch(self.fn, grid, self._merged(dynamic_args), constexprs, num_warps, maxnreg)
                return
            values = [None] * len(self.args)
            for i, v in zip(self._fixed_at, fixed_values, strict=True):
                values[i] = v
            self._values, self._ptrs, self._fixed_key = values, ptrs, tuple(fixed_key)
        key, dyn_values = _key(k, dynamic_args, self.dynamic)
        if key is None:
            launch(self.fn, grid, self._merged(dynamic_args), constexprs, num_warps, maxnreg)
            return
        get_device, get_stream, _ = drv
        device = get_device()
        key = (device, num_warps, tuple(constexprs[name] for name in k.constexprs), maxnreg, self._fixed_key, *key)
        kernel = k.bound.get(key)  # shared by every BoundLaunch of the kernel (check_forward makes one a call)
        if kernel is None:
            options = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
            kernel = self.fn[grid](*self._merged(dynamic_args), **constexprs, **options)
            if kernel is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "run"):
                k.bound[key] = kernel
            return
        values = self._values.copy()
        for i, v in zip(self.dynamic, dyn_values, strict=True):
            values[i] = v
        _run(kernel, grid, get_stream(device), values, key[2])

    def _merged(self, dynamic_args: tuple) -> tuple:
        args = self.args.copy()
        for i, a in zip(self.dynamic, dynamic_args, strict=True):
            args[i] = a
        return tuple(args)


def _key(k: _Kernel, args: tuple, positions: tuple[int, ...] | None = None) -> tuple[tuple | None, list]:
    """(the arguments' part of the key, the values to launch with), or (None, _) for an argument
    of a type the fast path does not take. ``positions``: the parameter index of each argument
    (default: 0, 1, ...)."""
    key, values = [], []
    lo, hi = _I32
    for i, a in zip(positions if positions is not None else range(len(args)), args, strict=True):
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
