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

A caller that checked its tensors' dtypes itself goes further with ``launch_typed``: it names a
``variant`` that fixes the dtypes and constexprs, and while every int fits int32, the kept kernel
is found by (device, warps, variant, each address modulo 16) without reading a dtype or building
the key.

The first launch of a key goes through Triton (compiling when it must) and the compiled kernel
it returns is kept; later launches call that kernel's launcher directly, tensors passed as their
addresses (the ops validated their devices). Triton's own launch serves instead under the
interpreter (``TRITON_INTERPRET=1``), while launch hooks or pre-run hooks are installed (a
profiler), for an argument of another type, and where the kernel Triton returns lacks the
launcher this module calls (then nothing is kept; the arguments are the same either way).

A kept kernel of ``launch_typed`` goes one step further where Triton's ``CudaLauncher`` would only
forward its arguments (no scratch buffers, no sanitizer; a release whose convention is known):
its C ``launch`` is called directly, with what ``CudaLauncher.__call__`` would hand it (``_direct``).
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
        self.typed: dict = {}  # ``launch_typed`` without fixed arguments: its key -> _Typed


class _Typed:
    """A kept kernel ``launch_typed`` relaunches for one (device, warps, variant, address
    residues): the fixed arguments' key and values it was kept with, and the constexprs' values.
    ``call``, ``lead``, ``packed``: the launcher's C call and what it takes ahead of the kernel's
    own arguments (``_direct``), or None, (), False where ``kernel.run`` serves."""

    __slots__ = ("kernel", "fixed_key", "head", "tail", "call", "lead", "packed")

    def __init__(self, kernel, fixed_key, head: list, tail: tuple):
        self.kernel, self.fixed_key, self.head, self.tail = kernel, fixed_key, head, tail
        self.call, self.lead, self.packed = _direct(kernel)


# The parameters of ``CudaLauncher.__call__`` (``kernel.run``), and how it hands them to its C
# ``launch``, by Triton release: "flat" (3.6) passes the kernel's arguments after the scratch
# buffers, "packed" (3.7-3.9) as one tuple after the annotations and signature.
_FLAT_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
_PACKED_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                "launch_enter_hook", "launch_exit_hook", "args")
_CONVENTIONS = {(3, 6): ("flat", _FLAT_CALL), (3, 7): ("packed", _PACKED_CALL), (3, 8): ("packed", _PACKED_CALL),
                (3, 9): ("packed", _PACKED_CALL)}


def _direct(kernel) -> tuple:
    """(the C launch, its arguments ahead of the kernel's, whether it takes those as one tuple)
    of a kept kernel whose launcher is the CUDA backend's ``CudaLauncher`` of a Triton release in
    ``_CONVENTIONS``, with that release's ``__call__`` parameters, and nothing its ``__call__``
    would add: no scratch buffers (global, profile) to allocate and no sanitizer. Its ``__call__``
    then only forwards its arguments, with None for both scratch buffers; between a model's
    launches the Python of that forwarding (a frame, two closures and their calls) costs several
    µs a launch. Else (None, (), False): ``kernel.run`` serves, as it always can."""
    none = (None, (), False)
    try:
        import inspect

        import triton

        run = kernel.run
        cls = type(run)
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
        convention = _CONVENTIONS.get((major, minor))
        if (convention is None or cls.__name__ != "CudaLauncher" or cls.__module__ != "triton.backends.nvidia.driver"
                or tuple(inspect.signature(cls.__call__).parameters) != convention[1]
                or run.global_scratch_size != 0 or run.profile_scratch_size != 0
                or getattr(run, "gsan_enabled", False)):
            return none
        function, coop, pdl = kernel.function, run.launch_cooperative_grid, run.launch_pdl
        if convention[0] == "flat":  # launch(g, g, g, stream, function, coop, pdl, scratch, scratch, *args)
            return run.launch, (function, coop, pdl, None, None, kernel.packed_metadata, None, None, None), False
        # launch(g, g, g, stream, function, coop, pdl, metadata, launch metadata, hooks, scratch, scratch,
        #        annotations, signature, args)
        return run.launch, (function, coop, pdl, kernel.packed_metadata, None, None, None, None, None,
                            run.arg_annotations, run.kernel_signature), True
    except (AttributeError, ImportError, TypeError, ValueError):
        return none


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
                get_device = active.get_current_device
                if get_device is torch.cuda.current_device:  # torch's: past its lazy init, its C call alone
                    get_device()
                    get_device = torch._C._cuda_getDevice
                _state["driver"] = (get_device, active.get_current_stream, knobs.runtime)
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

    __slots__ = ("args", "key", "values", "tensors", "addresses", "typed")

    def __init__(self, fn, args: tuple):
        self.args = tuple(args)
        self.tensors = tuple(a for a in self.args if isinstance(a, torch.Tensor))
        self.key, self.values, self.addresses = None, [], []  # no key: Triton's own launch (no fast path
        self.typed: dict = {}  # ``launch_typed`` with these arguments: its key -> _Typed
        if _driver() is not None:  # here, or an argument of a type it does not take)
            self.rekey(_kernel(fn))

    def rekey(self, k: _Kernel) -> None:
        self.key, self.values = _key(k, self.args)
        self.addresses = list(map(_ADDRESS, self.tensors))

    def moved(self) -> bool:
        """Whether a tensor's storage moved since it was keyed (an in-place resize): the launch keys
        the arguments again rather than pass a stale address."""
        return list(map(_ADDRESS, self.tensors)) != self.addresses


_ADDRESS = torch.Tensor.data_ptr


def _kernel(fn) -> _Kernel:
    k = _kernels.get(id(fn))
    if k is None or k.fn is not fn:
        k = _kernels[id(fn)] = _Kernel(fn)
    return k


def launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, fixed: Fixed | None = None):
    """``fn[grid](*args, **constexprs, num_warps=num_warps)``, through the kept compiled kernel
    when one matches (module doc). ``constexprs`` must name every constexpr of ``fn``. With
    ``fixed`` (a ``Fixed``), ``args`` are the arguments after its own. Returns the kept kernel
    that launched (or was kept by this launch), None where Triton's own launch served."""
    drv = _driver()
    if drv is None:
        fn[grid](*(fixed.args + args if fixed is not None else args), **constexprs, num_warps=num_warps)
        return None
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
        return None
    device = get_device()
    key = (device, num_warps, tuple(constexprs[name] for name in k.constexprs), *key)
    kernel = k.compiled.get(key)
    if kernel is None:
        kernel = fn[grid](*(fixed.args + args if fixed is not None else args), **constexprs, num_warps=num_warps)
        if kernel is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "run"):
            k.compiled[key] = kernel
            return kernel
        return None
    g = (*grid, 1, 1)
    kernel.run(g[0], g[1], g[2], get_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
               *values, *key[2])
    return kernel


def launch_typed(fn, grid: tuple, tensors: tuple, ints: tuple, variant, constexprs: dict, num_warps: int = 4,
                 fixed: Fixed | None = None, addresses: list | None = None) -> None:
    """``launch(fn, grid, tensors + ints, constexprs, num_warps, fixed)`` for a caller that checked
    every tensor's dtype: ``variant`` (hashable) stands for the tensors' dtypes and the
    ``constexprs``, the same every time it is passed with the same ``fn`` and ``fixed``; ``ints``
    are Python ints (not bools) of parameters Triton does not specialise. While every int fits
    int32 and no hook is installed, the kept kernel of (current device, ``num_warps``,
    ``variant``, each tensor address modulo 16) launches at once; otherwise, or the first time,
    ``launch`` keys the arguments (and keeps the kernel it launched for them).
    ``addresses``: the tensors' ``data_ptr()``, where the caller read them already."""
    drv = _driver()
    if drv is None:
        launch(fn, grid, tensors + ints, constexprs, num_warps, fixed)
        return
    get_device, get_stream, runtime = drv
    device = get_device()
    if addresses is None:
        addresses = list(map(_ADDRESS, tensors))
    cache = fixed.typed if fixed is not None else _kernel(fn).typed
    key = (device, num_warps, variant, tuple(map(_RESIDUE, addresses)))
    typed = cache.get(key)
    small = not ints or (max(ints) <= _I32[1] and min(ints) >= _I32[0])
    # ``Fixed.moved`` and ``_hooked`` written out: between a model's launches every Python call costs µs
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if (typed is not None and small
            and (fixed is None or (typed.fixed_key is fixed.key
                                   and list(map(_ADDRESS, fixed.tensors)) == fixed.addresses))
            and not getattr(fn, "pre_run_hooks", None)
            and (enter is None or not getattr(enter, "calls", True))
            and (leave is None or not getattr(leave, "calls", True))):
        g = (*grid, 1, 1)
        call = typed.call
        if call is None:
            kernel = typed.kernel
            kernel.run(g[0], g[1], g[2], get_stream(device), kernel.function, kernel.packed_metadata, None, None,
                       None, *typed.head, *addresses, *ints, *typed.tail)
        elif typed.packed:  # the launcher's own C call (``_direct``)
            call(g[0], g[1], g[2], get_stream(device), *typed.lead, (*typed.head, *addresses, *ints, *typed.tail))
        else:
            call(g[0], g[1], g[2], get_stream(device), *typed.lead, *typed.head, *addresses, *ints, *typed.tail)
        return
    kernel = launch(fn, grid, tensors + ints, constexprs, num_warps, fixed)
    if kernel is not None and small and all(type(i) is int for i in ints):
        k = _kernel(fn)
        if not k.specialised.intersection(range(k.num_args - len(ints), k.num_args)):
            cache[key] = _Typed(kernel, fixed.key if fixed is not None else None,
                                fixed.values if fixed is not None else [],
                                tuple(constexprs[name] for name in k.constexprs))


_RESIDUE = (15).__and__  # an address modulo 16 (what Triton's alignment specialisation reads)


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
