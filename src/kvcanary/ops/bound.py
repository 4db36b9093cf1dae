"""The bound launches of every op, in one place: an op with a caller's own arguments checked once
(a Canary's eager HEAD, TAIL, write marks and sweeps on CUDA), so that a call checks a batch's
layout with attribute reads and returns False, launching nothing, for one the op would refuse
(call the op: it raises the error that names the argument).

| bound         | op              | bound once                                         |
|---------------|-----------------|----------------------------------------------------|
| BoundCheck    | check_forward   | state, workspace, sources, mode, meta, window, marks, truth table, publication |
| BoundMarks    | mark_writes     | state, sources, meta                               |
| BoundVerify   | verify          | state, plan, sources, mode, meta                   |
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from kvcanary.core.record import LaunchPoint
from kvcanary.errors import InputError, InputTypeError, KVCanaryError
from kvcanary.ops._common import (
    BoundBuffers,
    cdiv,
    check_contiguous,
    check_same_device,
    check_table,
    check_tensor,
    vector_ok,
)
from kvcanary.ops._ring import validate_ring
from kvcanary.ops.check import _VALIDATED, _validate_forward
from kvcanary.ops.check_launch import CheckLaunch, check_split, held_arg
from kvcanary.ops.conflicts import WriteMarks, validate_marks
from kvcanary.ops.fingerprint import FingerprintMode, source_words, validate_meta, validate_sources
from kvcanary.ops.landed import BLOCK as MARK_BLOCK
from kvcanary.ops.landed import _mark_kernel
from kvcanary.ops.launcher import launch
from kvcanary.ops.plan import Plan, check_window
from kvcanary.ops.publish import validate_publication
from kvcanary.ops.sources import SourceSet
from kvcanary.ops.state import STATE_FIELDS, WS_FIELDS, DeviceState, check_state
from kvcanary.ops.verify import _VerifyLaunch, check_programs, validate_verify


class BatchMemo:
    """The device batch the bound checks sharing this memo (one canary's) last found laid out as
    their kernel reads it (``BoundCheck._sizes``): the same tensor objects, at the same
    addresses, pass again with the sizes read then, without their dtypes, shapes and strides read
    again (a forward's HEAD and TAIL get the same batch). An in-place change of a tensor's storage
    moves its address; one that keeps the address keeps the memory the sizes were checked
    against. Holds the tensors, so their memory cannot go to a new tensor while remembered."""

    __slots__ = ("batch", "lut", "index", "addresses", "sizes")

    # the batch's places in ``CheckLaunch.tensors``: rpi, prefix_lens, extend_lens, req_to_token,
    # then lut (when there is one), then input_ids, positions, out_cache_loc
    _TABLE, _LUT, _TOKENS = slice(0, 4), 4, slice(7, 10)

    def __init__(self):
        self.batch: tuple | None = None
        self.lut = self.index = self.addresses = self.sizes = None

    def holds(self, batch: tuple, lut, index: int) -> bool:
        """Whether ``batch`` (and ``lut``) are the tensor objects remembered, for the same device."""
        last = self.batch
        return last is not None and lut is self.lut and index == self.index and all(map(operator.is_, batch, last))

    def laid(self, addresses: list, lut) -> tuple | None:
        """The remembered sizes (n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0) where the
        held batch's tensors are at the addresses remembered (``addresses``: its
        ``CheckLaunch.tensors`` addresses now); else None."""
        if (addresses[self._TABLE] != self.addresses[0] or addresses[self._TOKENS] != self.addresses[1]
                or (lut is not None and addresses[self._LUT] != self.addresses[2])):
            return None
        return self.sizes

    def remember(self, batch: tuple, lut, addresses: list, index: int, sizes: tuple) -> None:
        """Remember ``batch``, laid out as the kernel reads it, and its ``sizes``."""
        self.batch, self.lut, self.index, self.sizes = batch, lut, index, sizes
        self.addresses = (addresses[self._TABLE], addresses[self._TOKENS], addresses[self._LUT])


_ADDRESS = torch.Tensor.data_ptr


class Bound:
    """A bound launch's per-call checks: its buffers (``BoundBuffers``: the state's, the
    workspace's and the write marks' fields read again, the KV words, their table, the truth
    table, the publication, the sources' geometry; one tuple compare) and the launch tag,
    passed to the kernel as the plain int it names."""

    __slots__ = ("buffers", "state", "_tags")

    def __init__(self, owner: str, state: DeviceState, named: dict, sources=(), parts=()):
        self.state = state
        self.buffers = BoundBuffers(owner, ((state, "state", STATE_FIELDS), *parts), named, sources)
        self._tags: set[int] = set()

    def check(self) -> None:
        self.buffers.check()

    def tag(self, tag) -> int:
        """The launch tag as a plain int (the kernel gets nothing else): checked once per value
        (``validate_ring``: an int in range; bools, floats and other objects refused, 0-d
        integer tensors and numpy integers converted by ``operator.index``)."""
        if type(tag) is int and tag in self._tags:
            return tag
        plain = validate_ring(self.state, tag)
        if type(tag) is int:
            self._tags.add(plain)
        return plain


class BoundCheck:
    """``check_forward`` at one launch point of one state with the caller's own arguments bound
    once (a Canary on CUDA: the state and its workspace, sources, meta, mode, window, write marks,
    truth table): on a device the per-call checks shrink to a few attribute reads. What
    ``check_forward`` checks splits:

    | what                                                   | checked                            |
    |--------------------------------------------------------|------------------------------------|
    | the bound arguments                                    | once, here: its errors, raised     |
    | the state's buffers, the tag                           | every call (the tag once per value)|
    | a batch's dtypes, ranks, lengths, device, contiguity, | every call, as reads that return   |
    | table layout, its fit in the workspace                 | False instead of raising           |
    | a device batch's values (rows, lengths, offsets)       | by the kernel, which masks, flags  |
    | a host batch                                           | ``check_forward``'s own checks     |

    A call returns False having launched nothing for a batch it does not take; the caller then
    runs ``check_forward`` (after ``scatter_req_token_ids`` for a batch's token truth), which
    raises the error that names the argument. Triton only (CUDA, or the CPU under the
    interpreter).

    ``publication``: (seq, rows) of ``ops.publish`` for the state's counter block, checked here; a
    call with ``publish=True`` then publishes the block from its last program out, after every
    other program of the launch has counted: the launch and ``publish_counters`` after it in one
    (an eager TAIL hands ``end_step`` its counters without a launch of their own).

    HEAD with the bound truth table also takes a batch's token truth (``truth_ids``,
    ``truth_offsets`` and, for appends, ``truth_starts``: ``scatter_req_token_ids``' ``flat_in``,
    ``offsets`` and ``starts``) and scatters it into the table and its lengths inside its own
    launch: ``scatter_req_token_ids`` then the check, in one launch. Each verifier program
    scatters its request's positions, those it verifies just before it reads them; the writers
    wait for every verifier, as before. Two requests on one page-table row leave the row as
    unspecified as the scatter does."""

    def __init__(self, state: DeviceState, *, stamp: bool, sources=(), mode: FingerprintMode = FingerprintMode.NONE,
                 meta: torch.Tensor | None = None, window: int = 0, marks: WriteMarks | None = None,
                 truth: torch.Tensor | None = None, truth_lens: torch.Tensor | None = None,
                 split: int | None = None, max_spins: int | None = None, memo: BatchMemo | None = None,
                 publication: tuple[torch.Tensor, torch.Tensor] | None = None):
        check_state(state)
        device = state.device
        kv = SourceSet.resolve(sources, mode, meta, state.num_slots, device)
        sources, mode, meta = kv.list(), kv.mode, kv.meta
        check_window(window)
        workspace = state.workspace(LaunchPoint.HEAD if stamp else LaunchPoint.TAIL)
        if workspace is None:
            raise InputError("BoundCheck needs a state with workspaces; allocate it with "
                             "DeviceState.allocate(..., max_bs=..., max_tokens=...)")
        if stamp and marks is None:
            marks = WriteMarks.allocate(state.num_slots, device)
        validate_marks(marks, None, state.num_slots, device)
        if (truth is None) != (truth_lens is None):
            raise InputError("truth and truth_lens go together: pass both or neither")
        if truth is not None:
            check_tensor("truth", truth, torch.int32, 2)
            check_table("truth", truth)
            check_tensor("truth_lens", truth_lens, torch.int64, 1)
            check_contiguous("truth_lens", truth_lens)
            check_same_device(records=state.records, truth=truth, truth_lens=truth_lens)
            if truth_lens.shape[0] < workspace.max_bs:
                raise InputError(f"truth_lens length {truth_lens.shape[0]} < the workspace's max_bs "
                                 f"({workspace.max_bs}); one length per request of the largest batch")
        check_split(split, max_spins)
        if memo is not None and not isinstance(memo, BatchMemo):
            raise InputTypeError(f"memo must be a BatchMemo or None, got {type(memo).__name__}")
        if publication is not None:
            if type(publication) is not tuple or len(publication) != 2:
                got = f"a tuple of {len(publication)}" if type(publication) is tuple else type(publication).__name__
                raise InputTypeError(f"publication must be a (seq, rows) tuple or None, got {got}")
            validate_publication(state.counter_block(), *publication)
        self.state, self.stamp, self.window = state, stamp, window
        self.truth, self.truth_lens = truth, truth_lens
        self.max_bs, self.max_tokens = workspace.max_bs, workspace.max_tokens
        self.index = device.index if device.type == "cuda" else -1  # Tensor.get_device() of the state's tensors
        self._bound = Bound("BoundCheck", state, {
            "meta": meta, "truth": truth, "truth_lens": truth_lens,
            **dict(zip(("publication seq", "publication rows"), publication or (), strict=False))}, sources,
            ((workspace, "workspace", WS_FIELDS), (marks, "marks", ("words", "epoch"))))
        self._launch = CheckLaunch(state, workspace, stamp, sources, mode, meta, marks, window, split, max_spins,
                                    publication)
        self.memo = memo if memo is not None else BatchMemo()

    def __call__(self, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 req_to_token: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 out_cache_loc: torch.Tensor, *, tag: int, truth: bool = False, lut: torch.Tensor | None = None,
                 held: torch.Tensor | None = None, publish: bool = False, truth_ids: torch.Tensor | None = None,
                 truth_offsets: torch.Tensor | None = None, truth_starts: torch.Tensor | None = None,
                 held_words: torch.Tensor | None = None) -> bool:
        """HEAD (the bound ``stamp``) or TAIL of one batch, with the bound truth table when
        ``truth``, publishing the counter block when ``publish``, scattering ``truth_ids`` by
        ``truth_offsets`` (from the columns ``truth_starts``, appends, where given) into the truth
        table first (HEAD with ``truth``), checking ``held`` or ``held_words`` (``check_forward``'s);
        True when launched (see the class doc)."""
        if publish is not False and (publish is not True or self._launch.publication is None):
            raise InputError(f"publish must be True or False, got {publish!r}" if publish is not True else
                             "publish=True but this BoundCheck has no publication; bind one with "
                             "BoundCheck(..., publication=(seq, rows))")
        scatter = truth_ids is not None or truth_offsets is not None
        if truth_starts is not None and not scatter:
            raise InputError("truth_starts needs truth_ids and truth_offsets (appends are scattered by HEAD); "
                             "got truth_ids None, truth_offsets None")
        if scatter and (truth_ids is None or truth_offsets is None or not self.stamp or truth is not True):
            raise InputError("truth_ids and truth_offsets go together, to HEAD (stamp=True) with truth=True; got "
                             f"truth_ids {'set' if truth_ids is not None else 'None'}, truth_offsets "
                             f"{'set' if truth_offsets is not None else 'None'}, stamp={self.stamp}, truth={truth!r}")
        self._bound.check()
        tag = self._bound.tag(tag)  # raises for a tag out of range, as check_forward does
        if truth and self.truth is None:
            return False
        truth_t = self.truth if truth else None
        truth_lens = self.truth_lens if truth else None
        batch = (req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc)
        if held is not None and (not self.stamp or not isinstance(held, torch.Tensor)
                                 or not vector_ok(held, held.shape[0], self.index)):
            return False
        counted = held_words is not None
        if counted:
            if (held is not None or not self.stamp or not isinstance(held_words, torch.Tensor)
                    or not vector_ok(held_words, held_words.shape[0], self.index) or held_words.shape[0] < 1):
                return False
            held = held_words
        if scatter and not self._scatter_ok(req_pool_indices, truth_ids, truth_offsets, truth_starts):
            return False
        if self.index < 0:  # a host batch: check_forward's value checks
            if not self._layout_ok(batch, lut, truth) or not self._host_ok(batch, truth_t, truth_lens, lut):
                return False
            laid, addresses = None, None
        else:
            memo, tensors = self.memo, None
            if memo.holds(batch, lut, self.index):
                tensors = self._launch.tensors(*batch, truth_t, truth_lens, lut, held, truth_ids, truth_offsets,
                                               truth_starts)
                addresses = list(map(_ADDRESS, tensors))
                laid = memo.laid(addresses, lut)
            else:
                laid = None
            if laid is None:
                laid = self._sizes(batch, lut, truth)
                if laid is None:
                    return False
                if tensors is None:
                    tensors = self._launch.tensors(*batch, truth_t, truth_lens, lut, held, truth_ids, truth_offsets,
                                                   truth_starts)
                    addresses = list(map(_ADDRESS, tensors))
                memo.remember(batch, lut, addresses, self.index, laid)
            elif laid[1] > self.max_bs or laid[0] > self.max_tokens or (truth and self.truth.shape[0] != laid[2]):
                return False
        # the whole lengths buffer: the kernel reads the first bs (check_forward's slice, without a view a call)
        if laid is None:
            self._launch.launch(*batch, truth_t, truth_lens, lut, held, tag, publish, truth_ids, truth_offsets,
                                truth_starts, counted)
        else:
            self._launch.launch_laid(tensors, lut is not None, truth, held_arg(held, counted), tag, laid,
                                     addresses, publish, truth_ids.shape[0] if scatter else -1,
                                     truth_starts is not None)
        return True

    def _layout_ok(self, batch: tuple, lut, truth: bool = False) -> bool:
        return self._sizes(batch, lut, truth) is not None

    def _scatter_ok(self, rpi, truth_ids, truth_offsets, truth_starts) -> bool:
        """Whether a batch's token truth is laid out as the kernel's scatter reads it."""
        index = self.index
        return (isinstance(truth_ids, torch.Tensor) and truth_ids.dim() == 1
                and vector_ok(truth_ids, truth_ids.shape[0], index) and isinstance(rpi, torch.Tensor)
                and vector_ok(truth_offsets, rpi.shape[0] + 1, index)
                and (truth_starts is None or vector_ok(truth_starts, rpi.shape[0], index)))

    def takes(self, batch: tuple, truth: bool = False, truth_ids=None, truth_offsets=None,
              truth_starts=None) -> tuple | None:
        """(n, bs, rows, max_ctx) of ``batch`` (rpi, prefix_lens, extend_lens, req_to_token,
        input_ids, positions, out_cache_loc) where a call would take its layout, with the bound
        truth table when ``truth`` and scattering its token truth where ``truth_ids`` is given
        (no lut); None where it would not. Reads attributes only: checks no value, launches
        nothing (the fixed buffers of ``runtime.eager_graphs`` are loaded from batches it takes)."""
        if truth and self.truth is None:
            return None
        laid = self._sizes(batch, None, truth)
        if laid is None or (truth_ids is not None and not self._scatter_ok(batch[0], truth_ids, truth_offsets,
                                                                          truth_starts)):
            return None
        return laid[:4]

    def _sizes(self, batch: tuple, lut, truth: bool = False) -> tuple | None:
        """(n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0) of a batch laid out as the kernel
        reads it (dtypes, ranks, lengths, device, contiguity, table layout, its fit in the
        workspace and the truth table); None for one it does not take."""
        rpi, prefix_lens, extend_lens, rtt, ids, pos, loc = batch
        index = self.index
        if not isinstance(rpi, torch.Tensor) or not isinstance(ids, torch.Tensor) or rpi.dim() != 1 or ids.dim() != 1:
            return None
        bs, n = rpi.shape[0], ids.shape[0]
        if bs > self.max_bs or n > self.max_tokens:
            return None
        for t, length in ((rpi, bs), (prefix_lens, bs), (extend_lens, bs), (ids, n), (pos, n), (loc, n)):
            if not vector_ok(t, length, index):
                return None
        if lut is not None and not (isinstance(lut, torch.Tensor) and vector_ok(lut, lut.shape[0], index)
                                    and lut.shape[0] >= 1):
            return None
        if (not isinstance(rtt, torch.Tensor) or rtt.dtype is not torch.int32 or rtt.dim() != 2
                or rtt.get_device() != index):
            return None
        rows, width = rtt.shape
        if rows < 1 or width < 1 or (width > 1 and rtt.stride(1) != 1) or (rows > 1 and rtt.stride(0) < width):
            return None
        if truth and self.truth.shape[0] != rows:
            return None
        return n, bs, rows, width, rtt.stride(0), lut.shape[0] if lut is not None else 0

    def _host_ok(self, batch: tuple, truth, truth_lens, lut) -> bool:
        checked = (*batch[:7], truth, truth_lens[: batch[0].shape[0]] if truth_lens is not None else None, lut)
        if not _VALIDATED.seen(self.state, checked, (self.window,)):
            try:
                _validate_forward(self.state.records, *checked, self.window)
            except KVCanaryError:
                return False
            _VALIDATED.remember(self.state, checked, (self.window,))
        return True


class BoundMarks:
    """``mark_writes`` into one state's sources with the state, the sources and their ``meta``
    checked once (a Canary's HEAD on CUDA); a call checks the batch's ``out_cache_loc`` and
    ``lut`` with attribute reads and returns False, having launched nothing, for ones
    ``mark_writes`` would refuse (the caller then calls it, which raises the error). Triton only."""

    def __init__(self, state: DeviceState, sources, meta: torch.Tensor | None = None,
                 mode: FingerprintMode = FingerprintMode.PARTIAL):
        check_state(state)
        if not isinstance(mode, FingerprintMode):
            raise InputTypeError(f"mode must be a FingerprintMode, got {type(mode).__name__} {mode!r}")
        sources = list(sources)
        if not sources:
            raise InputError("BoundMarks needs at least one source; without sources mark_writes marks nothing")
        validate_sources(sources, state.num_slots, state.device)
        self.state, self.meta = state, validate_meta(meta, sources, mode, state.device)
        self.words = source_words(sources, self.meta)
        self.constexprs = {lut: dict(HAS_LUT=lut, NUM_SOURCES=len(sources), BLOCK=MARK_BLOCK) for lut in (False, True)}
        self.index = state.device.index if state.device.type == "cuda" else -1
        self._bound = Bound("BoundMarks", state, {"meta": self.meta}, sources)

    def __call__(self, out_cache_loc: torch.Tensor, lut: torch.Tensor | None = None) -> bool:
        state, index = self.state, self.index
        self._bound.check()
        if not isinstance(out_cache_loc, torch.Tensor) or not vector_ok(out_cache_loc, out_cache_loc.shape[0], index):
            return False
        if lut is not None and not (isinstance(lut, torch.Tensor) and vector_ok(lut, lut.shape[0], index)
                                    and lut.shape[0] >= 1):
            return False
        n = out_cache_loc.shape[0]
        launch(_mark_kernel, (max(cdiv(n, MARK_BLOCK), 1),),
               (out_cache_loc, lut if lut is not None else out_cache_loc, *self.words, self.meta, n, state.num_slots,
                lut.shape[0] if lut is not None else 0), self.constexprs[lut is not None])
        return True


class BoundVerify:
    """``verify`` of one plan on one state with the state, the plan, the sources and their
    ``meta`` checked once (a Canary's sweeps on CUDA); a call checks that the state's, the
    plan's and the sources' buffers are still those bound (``layout_key``) and the tag, then
    launches: the
    plan's entries are device values, which the kernel masks. Triton only."""

    def __init__(self, state: DeviceState, plan: Plan, sources=(), mode: FingerprintMode = FingerprintMode.NONE,
                 meta: torch.Tensor | None = None, max_programs: int = 1024):
        _, kv = validate_verify(state, plan, 0, sources, mode, meta)
        sources, mode, meta = kv.list(), kv.mode, kv.meta
        check_programs(max_programs)
        self.state, self.plan = state, plan
        self._bound = Bound("BoundVerify", state, {"meta": meta}, sources,
                            ((plan, "plan", tuple(f.name for f in dataclasses.fields(Plan))),))
        self._launch = _VerifyLaunch(state, plan, sources, mode, meta, max_programs)

    def __call__(self, tag: int) -> None:
        self._bound.check()  # the state's, the plan's and the sources' buffers as bound
        self._launch.launch(self._bound.tag(tag))
