"""check_forward: a whole HEAD or TAIL of one forward in a single launch, straight from the page table.

HEAD (``stamp=True``) = ``build_plan`` + ``verify`` + ``check_writes`` + ``gather_expected_tokens`` +
``stamp`` + ``mark_writes`` into the sources (HEAD reads no K/V: its verify checks no fingerprint);
TAIL (``stamp=False``) = ``build_plan`` + ``verify`` with fingerprints + ``check_writes_landed`` +
``fingerprint(record=True)`` of the written slots that landed (translated through ``lut``). The
results are those of that sequence, byte for byte (rows in the ring in any order), with one
difference: there is no plan, so nothing overflows and every prefix entry is checked whatever
its count.

| argument          | dtype / shape        | meaning                                               |
|-------------------|----------------------|-------------------------------------------------------|
| state             | DeviceState          | records read, written (stamp / record); ring, stats   |
| req_pool_indices  | int64[bs]            | page-table row per request; row 0 = padding           |
| prefix_lens       | int64[bs]            | positions already cached (read)                       |
| extend_lens       | int64[bs]            | tokens this forward writes                            |
| req_to_token      | int32[rows, max_ctx] | page table                                            |
| input_ids         | int64[T]             | tokens written, request after request                 |
| positions         | int64[T]             | their positions                                       |
| out_cache_loc     | int64[T]             | their slots                                           |
| truth, truth_lens | int32[rows, w], int64[bs] | token history per row (optional)                 |
| lut, window       | int64[n], int        | sliding-window pool: slot translation, window (0 = full) |

One launch, ``1 + bs * split + cdiv(T, B)`` programs (B = ``WRITE_BLOCK``, 256 tokens, for HEAD; 128 for TAIL).
Programs take tickets from a device counter in the order they start (``Workspace.sync``), so
waiting on a lower ticket cannot deadlock: ticket 0 computes the write offsets and seeds (and
marks the held slots), the next ``bs * split`` tickets verify request ``r`` (split ``s`` walks
positions ``lo + s*V, lo + (s + split)*V, ...``), then, once ticket 0 has counted 2^32 into the
pre-phase word, each marks its share of the write targets (1024-token blocks dealt round-robin:
one program marking every target cost ~6 ns a written token, 3 ms for 32 x 16,384), and the rest
handle B written tokens each. Writers wait until every verifier is done (so a verifier never
sees a record this forward writes), then continue the chain across blocks with a decoupled
look-back over per-block sums (a flag per block: aggregate ready, with or without a segment start,
or inclusive prefix ready; tagged with a per-launch epoch, so nothing is reset between launches;
aggregate and inclusive sum in separate words, so a reader never takes one for the other).
The last program to finish bumps the epoch and, in a launch that publishes (``BoundCheck`` with a
``publication``, called with ``publish=True``: an eager TAIL), copies the counter block into the
publication's rows as ``ops.publish.publish_counters`` would after the launch. The workspace
holds no data between launches beyond the epoch: one ``Workspace`` per stream of launches.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops import _cpu
from kvcanary.ops._common import (
    Backend,
    Validated,
    check_contiguous,
    check_len,
    check_same_device,
    check_tensor,
    is_host,
    use_triton,
)
from kvcanary.ops._cpu import use_numba
from kvcanary.ops._ring import validate_ring
from kvcanary.ops.check_launch import CheckLaunch, check_split
from kvcanary.ops.conflicts import (
    WriteMarks,
    check_writes,
    counted_held,
    validate_held_words,
    validate_marks,
)
from kvcanary.ops.fingerprint import (
    FingerprintMode,
    fingerprint,
)
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import check_writes_landed, mark_writes
from kvcanary.ops.plan import Plan, _translate_torch, build_plan, validate_batch
from kvcanary.ops.sources import SourceSet
from kvcanary.ops.stamp import stamp as stamp_op
from kvcanary.ops.state import DeviceState, Workspace
from kvcanary.ops.verify import verify

_VALIDATED = Validated()  # the batch a state last checked: its TAIL skips what its HEAD checked


def validate_check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                   out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources, mode, meta=None):
    """``check_forward``'s checks of everything but the marks and held slots: (the tag, the
    launch point's workspace or None, the sources as a ``SourceSet``)."""
    tag = validate_ring(state, tag)
    canary = state.records
    if not isinstance(mode, FingerprintMode):
        raise InputTypeError(f"mode must be a FingerprintMode, got {mode!r}")
    batch = (req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc, truth,
             truth_lens, lut)
    if not _VALIDATED.seen(state, batch, (window,)):
        _validate_forward(canary, *batch, window)
        _VALIDATED.remember(state, batch, (window,))
    kv = SourceSet.resolve(sources, mode, meta, canary.shape[0], state.device)
    workspace = state.workspace(LaunchPoint.HEAD if stamp else LaunchPoint.TAIL)
    if workspace is not None:
        bs = req_pool_indices.shape[0]
        if workspace.max_bs < bs:
            raise InputError(f"state workspace max_bs {workspace.max_bs} < bs ({bs}); allocate the state with "
                             "DeviceState.allocate(..., max_bs=...) of at least the batch size")
        n = input_ids.shape[0]
        if workspace.max_tokens < n:
            raise InputError(f"state workspace max_tokens {workspace.max_tokens} < len(input_ids) ({n}); allocate "
                             "the state with DeviceState.allocate(..., max_tokens=...) of at least the tokens written")
    return tag, workspace, kv


def _validate_forward(canary, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                      out_cache_loc, truth, truth_lens, lut, window) -> None:
    """The batch's checks: dtypes, shapes, devices, layouts; on the host its values."""
    for name, t in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
        check_tensor(name, t, torch.int64, 1)
    n = input_ids.shape[0]
    check_len("positions", positions, n, "len(input_ids)")
    check_len("out_cache_loc", out_cache_loc, n, "len(input_ids)")
    validate_batch(req_pool_indices, prefix_lens, extend_lens, req_to_token, truth, truth_lens, lut, window)
    check_same_device(records=canary, req_pool_indices=req_pool_indices, input_ids=input_ids,
                      positions=positions, out_cache_loc=out_cache_loc)
    if is_host(extend_lens):
        total = int(extend_lens.numpy().sum())
        if total != n:
            raise InputError(f"extend_lens sum {total} != len(input_ids) ({n})")
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("input_ids", input_ids), ("positions", positions),
                    ("out_cache_loc", out_cache_loc), ("truth_lens", truth_lens), ("lut", lut)):
        if t is not None:
            check_contiguous(name, t)
    for name, t in (("req_to_token", req_to_token), ("truth", truth)):
        if t is not None and t.numel() and t.stride(1) != 1:
            raise InputError(f"{name} must have unit column stride, got strides {t.stride()}")


# --- torch path: the sequence of ops it replaces -----------------------------------------------

def _check_torch(state, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, window, tag, stamp,
                 sources, mode, meta, held):
    canary = state.records
    bs, (rows, max_ctx) = rpi.shape[0], rtt.shape
    active = (rpi >= 1) & (rpi < rows)
    p_end = prefix_lens.clamp(0, max_ctx)
    lo = (p_end - window).clamp(min=0) if window else torch.zeros_like(p_end)
    entries = int(torch.where(active, p_end - lo, torch.zeros_like(p_end)).sum()) if bs else 0
    plan = Plan.allocate(max(entries, 1), max(bs, 1), canary.device)
    build_plan(req_pool_indices=rpi, prefix_lens=prefix_lens, extend_lens=extend_lens, req_to_token=rtt, plan=plan,
               truth=truth, truth_lens=truth_lens, lut=lut, window=window, backend=Backend.TORCH)
    verify(state=state, plan=plan, tag=tag, sources=() if stamp else sources, mode=mode, meta=meta,
           backend=Backend.TORCH)
    woff = plan.write_offsets[: bs + 1]
    if stamp:
        check_writes(state=state, plan=plan, out_cache_loc=loc, input_ids=ids, positions=pos, req_pool_indices=rpi,
                     write_offsets=woff, tag=tag, lut=lut, held=held, backend=Backend.TORCH)
        expected = None
        if truth is not None:
            expected = gather_expected_tokens(truth=truth, truth_lens=truth_lens, req_pool_indices=rpi,
                                              prefix_lens=prefix_lens, extend_offsets=woff, input_ids=ids,
                                              backend=Backend.TORCH)
        stamp_op(state=state, out_cache_loc=loc, input_ids=ids, positions=pos, req_pool_indices=rpi,
                 prefix_lens=prefix_lens, write_offsets=woff, seed=plan.seed[:bs], tag=tag, expected_tokens=expected,
                 lut=lut, backend=Backend.TORCH)
        mark_writes(state=state, out_cache_loc=loc, sources=sources, lut=lut, backend=Backend.TORCH)
    elif sources:
        landed = check_writes_landed(state=state, out_cache_loc=loc, input_ids=ids, positions=pos, sources=sources,
                                     tag=tag, lut=lut, backend=Backend.TORCH)
        slots = _translate_torch(loc, lut)
        fingerprint(slots=torch.where(landed, slots, torch.zeros_like(slots)), sources=sources, mode=mode,
                    state=state, record=True, meta=meta, backend=Backend.TORCH)


def check_forward(*, state: DeviceState, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                  extend_lens: torch.Tensor, req_to_token: torch.Tensor, input_ids: torch.Tensor,
                  positions: torch.Tensor, out_cache_loc: torch.Tensor, tag: int, stamp: bool,
                  truth: torch.Tensor | None = None, truth_lens: torch.Tensor | None = None, sources=(),
                  mode: FingerprintMode = FingerprintMode.NONE, meta: torch.Tensor | None = None,
                  lut: torch.Tensor | None = None, window: int = 0, split: int | None = None,
                  max_spins: int | None = None, marks: WriteMarks | None = None, held: torch.Tensor | None = None,
                  held_words: torch.Tensor | None = None, backend: Backend = Backend.AUTO) -> None:
    """HEAD (``stamp=True``) or TAIL (``stamp=False``) of one forward (see module doc) on ``state``.
    Never raises on values; raises InputTypeError / InputError for wrong dtypes, shapes, devices,
    sources, meta, tag or a state whose workspace is too small, before anything is written. The
    kernel uses the state's HEAD or TAIL workspace (a fresh one per call when the state has none,
    which is not capturable). ``split``: programs per request verifying its prefix (None:
    ``verify_split`` on CUDA, 1 elsewhere, where the Triton interpreter runs programs one by one);
    the results do not depend on it. ``max_spins``: polls a waiting program makes before it gives
    up and raises ``DeviceFlag.WORKSPACE`` in ``state.error`` (None: 2**24 on CUDA, seconds of
    waiting; 64 elsewhere, where the interpreter runs programs in ticket order and never waits).
    HEAD also checks the write targets (``ops.conflicts``): ``marks`` is its scratch (allocated per
    call when None, which is not capturable), ``held`` the idle prefix-cache slots, or
    ``held_words`` the same counted (``ops.conflicts``: the count, then the slots; HEAD reads the
    count on the device and sets it to 0, so a captured HEAD checks each replay's holds once). With
    ``sources``, HEAD marks every write target in each source and TAIL reports the targets still
    marked as MISSED_WRITE and records no fingerprint for them (``ops.landed``); HEAD checks no
    fingerprint."""
    tag, workspace, kv = validate_check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids,
                                        positions, out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources,
                                        mode, meta)
    sources, mode, meta, device = kv.list(), kv.mode, kv.meta, state.device
    validate_marks(marks, held, state.num_slots, device)
    validate_held_words(held_words, held, device)
    check_split(split, max_spins)
    counted = stamp and held_words is not None
    if counted and not use_triton(backend, device):
        held = counted_held(held_words)
    if use_numba(backend, device):
        _cpu.check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                   out_cache_loc, truth, truth_lens, lut, held if stamp else None, tag, stamp, sources, meta, window)
        if counted:
            held_words[:1].zero_()
        return
    if not use_triton(backend, device):
        _check_torch(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                     out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources, mode, meta,
                     held if stamp else None)
        if counted:
            held_words[:1].zero_()
        return
    if workspace is None:
        workspace = Workspace.allocate(max(req_pool_indices.shape[0], 1), max(input_ids.shape[0], 1), device)
    if stamp and marks is None:
        marks = WriteMarks.allocate(state.num_slots, device)
    CheckLaunch(state, workspace, stamp, sources, mode, meta, marks, window, split, max_spins).launch(
        req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc, truth,
        truth_lens, lut, held_words if counted else held if stamp else None, tag, counted=counted)
