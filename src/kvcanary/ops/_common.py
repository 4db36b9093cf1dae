"""Shared validation and dispatch for the ops.

Every public op validates dtypes, ranks and devices always, validates values only when the
tensors live on the host (no device sync on the hot path), then dispatches: Triton on CUDA,
vectorised torch on CPU. ``backend=Backend.TRITON`` forces the kernel, which tests use on CPU
tensors under ``TRITON_INTERPRET=1``. ``check_forward``, ``verify`` and ``scatter_req_token_ids``
also have a compiled CPU kernel (``Backend.NUMBA``, ``ops._cpu``), their CPU default where numba
is installed and imports.
"""

from __future__ import annotations

import enum
import operator

import torch

from kvcanary.errors import InputError, InputTypeError

try:  # Triton is optional on platforms without wheels (macOS laptops): the torch path serves.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = _TritonStub()
    tl = None

__all__ = ["Backend", "HAS_TRITON", "triton", "tl", "use_triton", "check_tensor", "check_same_device",
           "is_host", "cdiv"]


class Backend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    NUMBA = "numba"  # the compiled CPU kernels of ops._cpu (check_forward, verify, scatter_req_token_ids)


def use_triton(backend: Backend, device: torch.device) -> bool:
    if backend in (Backend.TORCH, Backend.NUMBA):
        return False
    if backend is Backend.TRITON or device.type == "cuda":
        if not HAS_TRITON:
            raise InputError("the Triton backend was requested but triton is not installed; "
                               "install triton or pass backend=Backend.TORCH")
        return True
    return False


def check_tensor(name: str, t: object, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    """InputTypeError for a non-tensor or wrong dtype, InputError for a wrong rank; returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InputTypeError(f"{name} dtype {str(t.dtype).removeprefix('torch.')} != {want}")
    if t.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    device = items[0][1].device
    for k, v in items:
        if v.device.type == "meta":
            raise InputError(f"{k} is on the meta device, which holds no data; pass a CPU or CUDA tensor")
    for k, v in items[1:]:
        if v.device != device:
            raise InputError(f"{k} is on {v.device} but {items[0][0]} is on {device}; put all inputs on one device")
    return device


def check_len(name: str, t: torch.Tensor, expected: int, what: str) -> None:
    if t.shape[0] != expected:
        raise InputError(f"{name} length {t.shape[0]} != {what} ({expected})")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous (got strides {t.stride()}); pass {name}.contiguous()")


def vector_ok(t, length: int, index: int) -> bool:
    """Whether ``t`` is a contiguous int64[length] on the device of index ``index`` (-1: the CPU):
    the bound launches' per-call check, which reads attributes and raises nothing."""
    return (isinstance(t, torch.Tensor) and t.dtype is torch.int64 and t.dim() == 1 and t.shape[0] == length
            and t.get_device() == index and t.is_contiguous())


def check_lut(lut) -> None:
    """A sliding-window pool's slot table, where given: a non-empty contiguous int64[n] (the
    kernels read ``lut[slot]`` for slots in [0, n) as one run of memory)."""
    if lut is None:
        return
    check_tensor("lut", lut, torch.int64, 1)
    if lut.shape[0] < 1:
        raise InputError("lut is empty; a window table needs an entry per full-pool slot")
    check_contiguous("lut", lut)


def check_table(name: str, t: torch.Tensor) -> None:
    """A 2-D table the kernels index as ``ptr + row * stride(0) + col``: at least one row (row 0
    is padding) and one column, unit column stride, rows that do not overlap."""
    rows, width = t.shape
    if rows < 1 or width < 1:
        raise InputError(f"{name} shape {tuple(t.shape)} must have at least 1 row and 1 column "
                         "(row 0 is the padding row)")
    if (width > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < width):
        raise InputError(f"{name} must have unit column stride and non-overlapping rows, got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}; pass {name}.contiguous()")


def check_buffers(owner: str, obj, dtypes: dict[str, torch.dtype], lengths: dict[str, int], what: str) -> None:
    """The 1-D buffers of a hand-buildable dataclass (``owner``: its name): each of its dtype,
    contiguous, on the device of the first, of the length in ``lengths`` (``what`` names the
    sizes they follow)."""
    first = None
    for name, dtype in dtypes.items():
        t = check_tensor(f"{owner}.{name}", getattr(obj, name), dtype, 1)
        if not t.is_contiguous():
            raise InputError(f"{owner}.{name} must be contiguous, got strides {t.stride()}; use {owner}.allocate")
        first = first if first is not None else (name, t.device)
        if t.device != first[1]:
            raise InputError(f"{owner}.{name} is on {t.device} but {owner}.{first[0]} is on {first[1]}")
    for name, n in lengths.items():
        if getattr(obj, name).shape[0] != n:
            raise InputError(f"{owner}.{name} length {getattr(obj, name).shape[0]} != {n} ({what}); "
                             f"use {owner}.allocate")


def check_count(name: str, value, lo: int = 1) -> int:
    """A size argument: an int >= ``lo`` (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise InputError(f"{name} {value} < {lo}")
    return value


def check_programs(max_programs) -> None:
    """A persistent grid's program cap: an int in [1, 65535]."""
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or not 1 <= max_programs <= 65535:
        raise InputError(f"max_programs {max_programs!r} out of range [1, 65535]")


_ADDRESS, _SHAPE, _STRIDE = torch.Tensor.data_ptr, operator.attrgetter("shape"), torch.Tensor.stride
_DTYPE = operator.attrgetter("dtype")


def layout_key(tensors: tuple) -> tuple:
    """What a kernel indexes of each tensor, as one flat tuple: addresses, shapes, strides and
    dtypes. A buffer checked once and bound keeps its key while it is the buffer checked: a
    resize, a restride at the same address, a swap of two fields, another dtype (``resize_``,
    ``set_``, ``as_strided_``, ``.data =``) all change it. The device is implied: every buffer's
    device is checked when it is built, torch refuses ``.data =`` across device types, and a move
    between two CUDA devices moves the address (one virtual address space). Maps, not a
    generator: bound launches compare one at every call, where each Python frame costs
    microseconds (about 0.15 µs a tensor and attribute)."""
    return (*map(_ADDRESS, tensors), *map(_SHAPE, tensors), *map(_STRIDE, tensors), *map(_DTYPE, tensors))


def changed_buffers(names: tuple, tensors: tuple, key: tuple) -> str:
    """The names of the tensors whose layout differs from ``key`` (``layout_key`` of tensors of
    the same count), with what each was and is now: the message of a per-call check that failed."""
    n, now, parts = len(tensors), layout_key(tensors), []
    for i, name in enumerate(names):
        was_i, now_i = key[i::n], now[i::n]
        if was_i != now_i:
            moved = ", moved to another address" if was_i[0] != now_i[0] else ""
            parts.append(f"{name} {_show(was_i, tensors[i])} -> {_show(now_i, tensors[i])}{moved}")
    return "; ".join(parts) or "none"


def _show(values: tuple, t: torch.Tensor) -> str:
    _, shape, stride, dtype = values
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} strides {stride} on {t.device}"


_GEOMETRY = operator.attrgetter("num_slots", "bytes_per_token", "page_size", "page_stride_bytes", "half")
_WORDS = operator.attrgetter("words")


class BoundBuffers:
    """What a bound launch of ``ops.bound`` checked when it was built and re-checks at every call
    (its kernels take the tensors as they are at each call; ``ops._cpu.BoundForward`` instead
    holds the memory it views and checks nothing per call): the fields of the objects it reads
    (``parts``: (object, label, field names), read again at each call, so that a swap of two
    fields of a frozen object is seen), its KV sources' ``words`` (read again too) and geometry,
    and the tensors it holds itself (``named``).

    A call reads three attributes of each buffer, its address, torch's version counter and its
    dtype, and compares them with those of the last call (one tuple compare): every in-place
    change of a tensor's layout (``resize_``, ``set_``, ``as_strided_``, ``transpose_``, ...)
    bumps its version, ``.data =`` another tensor moves its address, and ``.data =`` a view of
    itself in another dtype changes the dtype. Where any differs (a write through torch bumps
    the version too), the full ``layout_key`` is compared with the one taken at binding: the
    same layout passes (and is remembered), another is refused. The KV words, which the model
    writes at every forward, keep a version counter of their own (``KVSource``), so the model's
    writes do not move it. What the reads cannot see, ``.data =`` a view of a tensor itself at
    its own address in its own dtype, keeps the storage and the element type: the kernels,
    which index it with the sizes bound, stay inside it. The full key costs about 1 µs a tensor
    on a loaded CPU, the three reads about 0.6."""

    __slots__ = ("owner", "parts", "names", "tensors", "sources", "key", "stamp")

    def __init__(self, owner: str, parts: tuple, named: dict, sources=()):
        self.owner = owner
        self.parts = tuple((obj, operator.attrgetter(*fields), label, fields) for obj, label, fields in parts
                           if obj is not None)
        named = {k: v for k, v in named.items() if v is not None}
        self.sources = tuple(sources)
        self.names = (tuple(f"{label}.{f}" for _, _, label, fields in self.parts for f in fields)
                      + tuple(f"sources[{i}].words" for i in range(len(self.sources))) + tuple(named))
        self.tensors = tuple(named.values())
        now = self._current()
        self.key = self._key(now)
        self.stamp = self._stamp(now)

    def _current(self) -> tuple:
        out = ()
        for obj, get, _, _ in self.parts:
            out += get(obj)
        return out + tuple(map(_WORDS, self.sources)) + self.tensors

    def _key(self, now: tuple) -> tuple:
        return layout_key(now) + tuple(map(_GEOMETRY, self.sources))

    def _stamp(self, now: tuple) -> tuple:
        return (*map(_ADDRESS, now), *map(_VERSION, now), *map(_DTYPE, now), *map(_GEOMETRY, self.sources))

    def check(self) -> None:
        """Raises InputError naming what changed since the launch was bound."""
        now = self._current()
        stamp = self._stamp(now)
        if stamp == self.stamp:
            return
        if self._key(now) == self.key:
            self.stamp = stamp  # written through torch, laid out as bound
            return
        for obj, _, _, _ in self.parts:
            obj.check()
        for i, src in enumerate(self.sources):
            src.check(f"sources[{i}] bound to this {self.owner}")
        raise InputError(f"buffers bound to this {self.owner} were resized or replaced since it was built "
                         "(their shape, strides, dtype or address changed): "
                         f"{changed_buffers(self.names, now, self.key[:4 * len(now)])}; bind it again")


_VERSION = operator.attrgetter("_version")


def check_aligned(name: str, t: torch.Tensor, align: int, what: str) -> None:
    """A buffer a kernel reads as ``align``-byte words starts on such a word."""
    if t.data_ptr() % align:
        raise InputError(f"{name} starts {t.data_ptr() % align} bytes past a {align}-byte boundary ({what}); "
                         "pass the buffer itself or a view at a multiple of its word size")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` reaches, [first, last)."""
    start = t.data_ptr()
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
    return start, start + (reach + 1) * t.element_size()


def check_no_alias(name: str, out: torch.Tensor, inputs: dict) -> None:
    """An op's output shares no byte with its inputs (``inputs``: name -> tensor or None): the
    backends read and write in different orders, so an output over an input would give each its
    own result (and overwrite the input)."""
    if not out.numel():
        return
    lo, hi = _span(out)
    for other, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.numel() and t.device == out.device:
            a, b = _span(t)
            if a < hi and lo < b:
                raise InputError(f"{name} shares memory with {other}; pass a separate {name} buffer "
                                 f"(or none: the op allocates one)")


def is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_bits(n: int) -> int:
    """Iterations a branchless binary search over ``n`` sorted entries needs."""
    return max(int(n).bit_length(), 1)


def searchsorted_right(sorted_ends: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Count of entries of ``sorted_ends`` that are <= each value (the owning segment index)."""
    return torch.searchsorted(sorted_ends.contiguous(), values.contiguous(), right=True)


class Validated:
    """The inputs that last passed a validation, per key (a DeviceState): the same tensors (the
    same objects, or views of the same base, e.g. ``truth_lens[:bs]`` again), unchanged since
    (address, shape, strides and torch's in-place version counter), with the same other
    arguments, pass again without their checks. HEAD and TAIL of one forward get the same batch
    tensors: the batch is validated once. Holds the tensors (or bases) it remembers, so their
    memory cannot be handed to a new tensor while remembered; at most ``size`` keys."""

    def __init__(self, size: int = 16):
        self._size = size
        self._last: dict[int, tuple] = {}

    @staticmethod
    def _stamp(t) -> tuple | None:
        if t is None:
            return None
        base = t._base
        return (t if base is None else base, t._version, t.data_ptr(), t.shape, t.stride())

    def seen(self, owner, tensors: tuple, scalars: tuple) -> bool:
        last = self._last.get(id(owner))
        if last is None or last[0] is not owner or last[1] != scalars or len(last[2]) != len(tensors):
            return False
        for t, was in zip(tensors, last[2], strict=True):
            now = self._stamp(t)
            if now is None or was is None:
                if now is not was:
                    return False
            elif now[0] is not was[0] or now[1:] != was[1:]:
                return False
        return True

    def remember(self, owner, tensors: tuple, scalars: tuple) -> None:
        if len(self._last) >= self._size and id(owner) not in self._last:
            self._last.clear()
        self._last[id(owner)] = (owner, scalars, tuple(self._stamp(t) for t in tensors))
