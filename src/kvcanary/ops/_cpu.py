"""Compiled CPU kernels (numba): a whole HEAD or TAIL of ``check_forward``, a plan's ``verify``
and the truth scatter, in one call each; their source is ``ops._cpu_kernels`` and ``ops._cpu_scatter``.

On a CPU the torch paths spend their time in dispatch, not arithmetic: a decode step's HEAD and
TAIL are a few hundred entries each, and every one of their ~400 small torch calls costs a few
microseconds whatever its size. These kernels walk the same entries once, in plain loops, and
produce exactly what the torch paths produce: the same record bytes, ring rows (in the same
order), counter and stats (tests/ops compare all of them with the torch paths, the Triton
kernels and the pure-Python references).

| kernel    | replaces (torch path)                                                              |
|-----------|------------------------------------------------------------------------------------|
| ``check`` | HEAD: ``build_plan`` -> ``verify`` -> ``check_writes`` -> ``gather`` -> ``stamp``;  |
|           | TAIL: ``build_plan`` -> ``verify`` with fingerprints -> ``fingerprint(record)``     |
| ``verify``| ``verify`` of a plan (sweeps, landed copies)                                        |
| ``scatter``| ``scatter_req_token_ids``                                                          |

``check`` builds no plan: it verifies each entry as it walks the page table, and at TAIL folds
each distinct slot's fingerprint once (requests that share a prefix read the same slots).

Numba is optional: ``usable()`` is False where it is missing or fails to import, and the torch
paths serve. It is imported on first use, not with kvcanary (importing it takes about half a
second). Each kernel has one explicit signature (C-contiguous arrays where every caller passes
them, any layout for tables and K/V sources), compiled on first use and cached next to its
source, so a machine compiles it once; ``compile_kernels()`` does it up front (and calls each
kernel once on dummies, so no step pays numba's first-call type resolution) and returns the
seconds it took. Arguments are numpy views of the op's tensors (``torch.Tensor.numpy()``,
shared storage); absent optional tensors are passed as 1-element dummies with their flag off.
``BoundForward`` binds everything but the batch once: a CPU Canary's per-step path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time

import numpy as np
import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS, STAT_LAUNCHES, VIOLATION_ROW_WIDTH
from kvcanary.errors import InputError
from kvcanary.ops import _cpu_kernels as _k
from kvcanary.ops import _cpu_scatter as _ks
from kvcanary.ops._common import Backend
from kvcanary.ops._cpu_kernels import _HELD, _LUT, _SCATTER, _STAMP, _STARTS, _TRUTH, _UNMARKED

log = logging.getLogger("kvcanary")

HAS_NUMBA = importlib.util.find_spec("numba") is not None

_compiled: dict[str, object] = {}
_lock = threading.Lock()
_usable: bool | None = None
_jitted = False
_SOURCES = (_k, _ks)  # the modules holding kernels' source (``CALLED``, ``INLINED``, ``KERNELS``)


def kernel(name: str):
    """The compiled kernel ``"check"``, ``"verify"`` or ``"scatter"`` (compiled, or loaded from the
    on-disk cache, on first use). Raises RuntimeError where numba is missing."""
    fn = _compiled.get(name)
    if fn is not None:
        return fn
    if not HAS_NUMBA:
        raise RuntimeError("the numba backend was requested but numba is not installed; "
                           "install numba or pass backend=Backend.TORCH")
    with _lock:
        import numba

        global _jitted
        if not _jitted:  # the called functions become numba functions before the first kernel compiles
            for module in _SOURCES:
                for fn_name in module.CALLED:
                    setattr(module, fn_name, numba.njit(error_model="numpy")(getattr(module, fn_name)))
                for fn_name in module.INLINED:
                    setattr(module, fn_name, numba.njit(inline="always")(getattr(module, fn_name)))
            _jitted = True
        module = next(m for m in _SOURCES if name in m.KERNELS)
        py, sig = module.KERNELS[name]
        fn = _compiled[name] = numba.njit(sig, cache=True, nogil=True, error_model="numpy")(getattr(module, py))
    return fn


def usable() -> bool:
    """Whether the compiled kernels serve here: numba imports and every kernel compiles (once per
    process; a failure is logged once and the torch paths serve)."""
    global _usable
    if _usable is None:
        if not HAS_NUMBA:
            _usable = False
        else:
            try:
                if _cache_is_cold():  # the first run would otherwise sit silent while numba compiles
                    print("kv-canary: compiling the CPU kernels once for this install (about 15 s)", file=sys.stderr,
                          flush=True)
                for name in (*_k.KERNELS, *_ks.KERNELS):
                    kernel(name)
                _warm_dispatch()
                _usable = True
            except Exception as exc:  # a broken install (numba vs numpy versions): fall back, loudly once
                log.warning("kv_canary: the compiled CPU kernels are unavailable (%s: %s); the torch paths serve",
                            type(exc).__name__, exc)
                _usable = False
    return _usable


def _cache_is_cold() -> bool:
    """Whether numba's on-disk cache lacks a kernel (no index, or one older than the source)."""
    try:
        from numba.core.caching import FunctionCache

        indexes = [FunctionCache(getattr(_k, py))._cache_file._index_path for py, _ in _k.KERNELS.values()]
    except Exception:  # numba's cache layout is not public API: no notice rather than no kernels
        return False
    source = os.path.getmtime(_k.__file__)
    return any(not os.path.exists(p) or os.path.getmtime(p) < source for p in indexes)


def _warm_dispatch() -> None:
    """One call of each kernel on empty dummies (nothing outside them is touched): the first call
    of a compiled function with given argument types costs milliseconds of type resolution in
    numba's dispatcher (and numpy imports ``numpy.ma`` for it), which no step should pay."""
    i64, i32 = (lambda *shape: np.zeros(shape, dtype=np.int64)), (lambda *shape: np.zeros(shape, dtype=np.int32))
    stats, ring = i64(NUM_LAUNCH_TAGS, NUM_STATS), i64(1, VIOLATION_ROW_WIDTH)
    kv = (i32(4), i32(4), i32(4), i32(4))
    batch = (i64(0), i64(0), i64(0), i32(1, 1), i64(0), i64(0), i64(0))
    kernel("check")(i64(2, 4), *batch, i32(1, 1), i64(1), i64(0), i64(1), i64(0), i64(1), i64(1), i64(2, 2), ring,
                    i64(1), stats, *kv, i64(4, 4), i64(2), 0, 0, 0, 0, _SCATTER | _STARTS)
    plan = [i32(1) for _ in range(6)]
    kernel("verify")(i64(2, 4), *plan, i64(1), i32(1), ring, i64(1), stats, *kv, i64(4, 4), i64(2), 0, 0, 0)
    kernel("scatter")(i64(0), i64(1), i64(0), i32(1, 1), i32(1), i64(1), True, True, i64(0), True)


def compile_kernels() -> float:
    """Compile (or load from the cache) every kernel now; returns the seconds it took (0 where
    numba does not serve)."""
    t0 = time.perf_counter()
    return time.perf_counter() - t0 if usable() else 0.0


def use_numba(backend: Backend, device: torch.device) -> bool:
    """The compiled CPU kernel: when asked for, or by default on the CPU where numba serves
    (installed, imports, compiles; otherwise the torch path)."""
    if backend is Backend.NUMBA:
        if device.type != "cpu":
            raise InputError(f"backend=Backend.NUMBA runs on CPU tensors, got tensors on {device}; "
                             "pass backend=Backend.AUTO")
        if not usable():
            raise InputError("the numba backend was requested but numba is not installed (or does not import); "
                             "install numba or pass backend=Backend.TORCH")
        return True
    return backend is Backend.AUTO and device.type == "cpu" and usable()


_DUMMY_I32_1 = np.zeros(1, dtype=np.int32)
_DUMMY_I32_2 = np.zeros((1, 1), dtype=np.int32)
_DUMMY_I64_1 = np.zeros(1, dtype=np.int64)
_DUMMY_I64_2 = np.zeros((1, 4), dtype=np.int64)

_views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
_scratch: dict[tuple[int, int], np.ndarray] = {}


def _np(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()``, kept for the buffers that live as long as their canary (records, ring, stats,
    KV sources): the same tensor with the same storage gives the same view."""
    hit = _views.get(id(t))
    if hit is not None and hit[0] is t and hit[1].ctypes.data == t.data_ptr() and hit[1].shape == tuple(t.shape):
        return hit[1]
    if len(_views) > 256:  # tests build thousands of canaries: forget the old ones
        _views.clear()
    a = t.numpy()
    _views[id(t)] = (t, a)
    return a


def _marks(num_slots: int) -> np.ndarray:
    """The write-conflict scratch of a pool size (int64[2, num_slots], all unmarked between calls),
    one per thread: allocated once, not per step."""
    key = (num_slots, threading.get_ident())
    a = _scratch.get(key)
    if a is None:
        if len(_scratch) > 64:
            _scratch.clear()
        a = _scratch[key] = np.full((2, num_slots), _UNMARKED, dtype=np.int64)
    return a


def _kv(sources) -> list:
    return [_np(s.words) for s in sources] + [_DUMMY_I32_1] * (4 - len(sources))


_state_views: dict[int, tuple] = {}


def _state_arrays(state, sources, meta) -> tuple:
    """The numpy views of a state's buffers (records as int64 words, ring, counter, stats), its
    fingerprint sources and their table, kept per state: the ops check a state's buffers on every
    call (``DeviceState.check``), so views of them stay views of the same memory."""
    hit = _state_views.get(id(state))
    words = tuple(s.words for s in sources)
    if hit is not None and hit[0] is state and hit[1] is meta and len(hit[2]) == len(words) \
            and all(a is b for a, b in zip(hit[2], words, strict=True)):
        return hit[3]
    if len(_state_views) > 64:
        _state_views.clear()
    arrays = (state.records.numpy().view(np.int64), state.ring.numpy(), state.ring_counter.numpy(),
              state.stats.numpy(), *_kv(sources), meta.numpy() if sources else _DUMMY_I64_2,
              state.source_tags.numpy(), sum(int(src.half) << i for i, src in enumerate(sources)))
    _state_views[id(state)] = (state, meta, words, arrays)
    return arrays


def check(state, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held, tag: int,
          stamp: bool, sources, meta, window: int) -> None:
    """``check_forward`` on CPU tensors (validated by the caller) through the compiled kernel."""
    flags = (_STAMP if stamp else 0) | (_TRUTH if truth is not None else 0) | (_LUT if lut is not None else 0) \
        | (_HELD if held is not None and stamp else 0)
    words, ring, counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags, halves = _state_arrays(state, sources, meta)
    status = kernel("check")(
        words, rpi.numpy(), prefix_lens.numpy(), extend_lens.numpy(), rtt.numpy(), ids.numpy(), pos.numpy(),
        loc.numpy(), _np(truth) if truth is not None else _DUMMY_I32_2,
        truth_lens.numpy() if truth_lens is not None else _DUMMY_I64_1, _DUMMY_I64_1, _DUMMY_I64_1, _DUMMY_I64_1,
        lut.numpy() if lut is not None else _DUMMY_I64_1, held.numpy() if flags & _HELD else _DUMMY_I64_1,
        _marks(state.num_slots), ring, counter, stats, kv0, kv1, kv2, kv3, meta_np,
        src_tags, len(sources), halves, window, tag, flags)
    assert status == 0, "check_forward validated values the kernel refused"


def verify(state, plan, tag: int, sources, meta) -> None:
    """``verify`` of a plan on CPU tensors (validated by the caller) through the compiled kernel."""
    words, ring, counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags, halves = _state_arrays(state, sources, meta)
    kernel("verify")(
        words, _np(plan.slot), _np(plan.pred), _np(plan.position), _np(plan.token), _np(plan.entry), _np(plan.row),
        _np(plan.count), _np(plan.enable), ring, counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags,
        len(sources), halves, tag)


def scatter(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out=None, starts=None) -> None:
    """``scatter_req_token_ids`` on CPU tensors (validated by the caller) through the compiled kernel;
    ``lens_out`` (int64[>= bs] or None): each request's segment length too; ``starts`` (int64[bs]
    or None): appends, each segment from its column on."""
    kernel("scatter")(flat_in.numpy(), offsets.numpy(), req_pool_indices.numpy(), _np(pool_out), error_flag.numpy(),
                      _DUMMY_I64_1 if lens_out is None else _np(lens_out), lens_out is not None, False,
                      _DUMMY_I64_1 if starts is None else starts.numpy(), starts is not None)


class BoundForward:
    """``check_forward`` and the truth scatter of one pool, with every argument but the batch
    bound once: the state's views, sources, fingerprint table, truth table and lengths, window,
    conflict scratch (a Canary's per-step path on the CPU, ``runtime.cpu_forward``). The batch
    comes as numpy views (``batch_arrays``). Each call returns False, having written nothing,
    when the batch's values are out of the ranges the ops accept or an array is not contiguous:
    the caller then runs the op itself, which raises its error. The caller checks the rest of
    what the ops check once per batch (``validation.host_forward_ok``).

    The bound buffers are checked once, when the launch is bound, and never again: the kernels
    read and write only the memory of the numpy views made here, and that memory cannot move or
    go away while the launch lives. ``.numpy()`` makes a storage non-resizable (torch refuses to
    grow it from then on, the engine's KV buffer included), and each view holds its storage
    itself, so whatever later happens to the tensor objects (``set_``, ``.data =``, a swapped
    field of the state or a source) leaves the views on live memory of the sizes bound. Such a
    change does not reach the launch: it goes on with the buffers it was bound to, while the ops,
    which take the objects as they are at each call, check them and refuse the changed ones."""

    def __init__(self, state, sources, meta, truth, truth_lens, window: int, capacity: int):
        state.check()
        for i, src in enumerate(sources):
            src.check(f"sources[{i}] bound to this BoundForward")
        self.state_arrays = _state_arrays(state, sources, meta)
        self.num_sources, self.window = len(sources), window
        self.truth, self.truth_lens = truth.numpy(), truth_lens.numpy()
        # this canary's own conflict scratch: the per-thread one of ``_marks`` would be shared by two
        # canaries of one pool size, whose kernels may run at once (no GIL) on two threads
        self.scratch = np.full((2, state.num_slots), _UNMARKED, dtype=np.int64)
        self.error = state.error.numpy()
        self.stats_words = memoryview(self.state_arrays[3].reshape(-1))
        self._check, self._scatter, self._verify = kernel("check"), kernel("scatter"), kernel("verify")
        self.capacity = capacity

    @staticmethod
    def check_tag(tag: int) -> None:
        """The per-call check: the tag a plain int in range (the kernels index the stats by it)."""
        if type(tag) is not int or not 0 <= tag < NUM_LAUNCH_TAGS:
            raise InputError(f"tag {tag!r} must be an int in [0, {NUM_LAUNCH_TAGS}); pass LaunchTag(...).value")

    def scatter(self, flat_in: np.ndarray, offsets: np.ndarray, rpi: np.ndarray, starts: np.ndarray | None = None
                ) -> bool:
        """Token truth of the batch into the truth table and each request's length into the lengths
        (``starts``: appends, each from its column on)."""
        try:
            return self._scatter(flat_in, offsets, rpi, self.truth, self.error, self.truth_lens, True, True,
                                 _DUMMY_I64_1 if starts is None else starts, starts is not None) == 0
        except TypeError:  # a non-contiguous array: refused by the signature before anything ran
            return False

    def check(self, batch: tuple, held: np.ndarray | None, tag: int, stamp: bool, truth: bool,
              scatter: tuple | None = None) -> bool:
        """HEAD (``stamp``) or TAIL of ``batch`` = ``batch_arrays(...)``; ``truth``: check tokens
        against the truth table; ``scatter``: the forward's (truth ids, offsets, starts or None),
        scattered into the truth table and lengths first, in the same call (with starts: appends,
        each from its column on); ``held``: int64 numpy slots or None."""
        self.check_tag(tag)
        rpi, prefix, extend, rtt, ids, pos, loc, lut = batch
        words, ring, counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags, halves = self.state_arrays
        flat, offsets, starts = scatter if scatter is not None else (_DUMMY_I64_1, _DUMMY_I64_1, None)
        flags = (_STAMP if stamp else 0) | (_TRUTH if truth else 0) | (_LUT if lut is not None else 0) \
            | (_HELD if held is not None and stamp else 0) | (_SCATTER if scatter is not None else 0) \
            | (_STARTS if starts is not None else 0)
        try:
            return self._check(
                words, rpi, prefix, extend, rtt, ids, pos, loc, self.truth if truth or scatter else _DUMMY_I32_2,
                self.truth_lens if truth or scatter else _DUMMY_I64_1, flat, offsets,
                _DUMMY_I64_1 if starts is None else starts, _DUMMY_I64_1 if lut is None else lut,
                held if flags & _HELD else _DUMMY_I64_1, self.scratch, ring, counter, stats, kv0, kv1, kv2, kv3,
                meta_np, src_tags, self.num_sources, halves, self.window, tag, flags) == 0
        except TypeError:  # a non-contiguous batch array: refused by the signature before anything ran
            return False

    def verify(self, slot: list, pred: list, position: list, token: list, tag: int) -> bool:
        """``verify`` of a sweep plan holding these entries (host lists; idle slots, row 0), at most
        ``capacity`` of them, fingerprints included; False (nothing written) where they do not fit
        that plan."""
        self.check_tag(tag)
        n = len(slot)
        if n > self.capacity:
            return False
        if n == 0:  # what the kernel does with no entries: count the launch (through CPython, not numpy)
            self.stats_words[tag * NUM_STATS + STAT_LAUNCHES] += 1
            return True
        plan = np.empty((6, n), dtype=np.int32)  # filled row by row: one list of 6 converts element by element
        try:
            plan[0], plan[1], plan[2], plan[3], plan[4] = slot, pred, position, token, slot
        except (OverflowError, ValueError):  # values the plan's int32 columns cannot hold
            return False
        plan[5] = 0
        words, ring, counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags, halves = self.state_arrays
        self._verify(words, plan[0], plan[1], plan[2], plan[3], plan[4], plan[5], np.array([n]), _ONE_I32, ring,
                     counter, stats, kv0, kv1, kv2, kv3, meta_np, src_tags, self.num_sources, halves, tag)
        return True


_ONE_I32 = np.ones(1, dtype=np.int32)


def batch_arrays(rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, lut) -> tuple:
    """Numpy views of a forward's CPU tensors, for ``BoundForward.check`` (``lut`` may be None)."""
    return (rpi.numpy(), prefix_lens.numpy(), extend_lens.numpy(), rtt.numpy(), ids.numpy(), pos.numpy(), loc.numpy(),
            None if lut is None else lut.numpy())
