"""A Canary's per-forward work on the CPU: the truth scatter with HEAD, and TAIL, as one compiled
call each (``ops.backend.BoundForward``), with the Python around them cut to what changes per batch.

On a CPU the ops' own argument checks cost more than the kernel they guard (a decode step of
the tiny model: ~70 µs of checks around ~40 µs of HEAD). What they check splits three ways:

| what                                             | checked                                     |
|--------------------------------------------------|---------------------------------------------|
| the canary's own buffers, sources and their table | once, when the canary is built (``SourceSet``) |
| a batch's dtypes, ranks, lengths, device          | by ``ForwardBatch`` when the batch is built |
| its table strides and sizes                       | once per batch (``host_forward_ok``)        |
| its contiguity                                    | by the kernel's signature, at every call    |
| its values (rows, lengths, offsets, their sums)   | by the kernel on every call, before writing |

Whatever fails, the call returns False having written nothing, and the Canary runs the op
itself, which raises the error that names the argument (or, where it accepts, produces the
same bytes: the kernels are the same). The batch's numpy views are made once for its HEAD and
TAIL. ``prepare_head`` leaves the truth scatter to HEAD's call (the table is read by HEAD and
TAIL alone): when that call refuses the batch, the Canary makes the scatter through the op
first (which raises for bad offsets or rows), then runs the ops.
"""

from __future__ import annotations

import torch

from kvcanary.config import CanaryConfig
from kvcanary.ops.backend import BoundForward, batch_arrays
from kvcanary.ops.sources import SourceSet
from kvcanary.ops.state import DeviceState
from kvcanary.ops.validation import host_forward_ok
from kvcanary.runtime.batch import ForwardBatch


class CpuForward:
    """The compiled per-forward path of one CPU Canary (see the module doc)."""

    def __init__(self, config: CanaryConfig, state: DeviceState, kv: SourceSet, truth: torch.Tensor,
                 truth_lens: torch.Tensor, window: int, sweep_capacity: int):
        self.config, self.state = config, state
        # the sources and their table: checked when ``kv`` was built; None here: every call takes the op
        self.bound: BoundForward | None = BoundForward(state, kv.list(), kv.meta, truth, truth_lens, window,
                                                       sweep_capacity)
        self.truth_rows = truth.shape[0]
        self.error = memoryview(state.error.numpy())  # the error flags, read at every end_step (CPython, not numpy)
        ws = state.workspaces[0] if state.workspaces else None
        self.max_bs, self.max_tokens = (ws.max_bs, ws.max_tokens) if ws is not None else (0, 0)
        self.lut = window > 0  # a window pool reads the batch through its slot_lut
        self._batch: ForwardBatch | None = None
        self._arrays: tuple | None = None
        self._tensors: tuple = ()
        self._scatter_for: ForwardBatch | None = None  # prepare_head's batch, its truth scatter left to its HEAD
        self._ptrs: list = []

    def _arrays_of(self, b: ForwardBatch) -> tuple | None:
        """The numpy views of ``b``'s tensors (made once per batch), or None when its layout is
        one ``check_forward`` refuses."""
        if b is self._batch and [t.data_ptr() for t in self._tensors] == self._ptrs:
            return self._arrays  # the same tensors in place (a resize would leave the views on freed memory)
        self._batch = self._arrays = None
        lut = b.slot_lut if self.lut else None
        tensors = (b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids, b.positions,
                   b.out_cache_loc)
        if self.bound is None or not host_forward_ok(tensors[0], tensors[4], tensors[3], lut,
                                                     self.truth_rows if self.config.truth else None,
                                                     self.max_bs, self.max_tokens):
            return None
        try:
            self._arrays = batch_arrays(*tensors, lut)
        except (TypeError, RuntimeError):  # not CPU memory numpy can view (another device, autograd)
            return None
        self._tensors = tensors if lut is None else (*tensors, lut)
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self._batch = b
        return self._arrays

    def defer_scatter(self, b: ForwardBatch) -> bool:
        """Leave ``b``'s truth scatter (whole histories, or appends: ``truth_starts``) to its HEAD
        (``check``), which makes it in the same compiled call; False where this path does not
        serve (the caller scatters now)."""
        if self.bound is None:
            return False
        self._scatter_for = b
        return True

    def take_scatter(self) -> ForwardBatch | None:
        """The batch whose truth scatter is still to be made (by the caller, before it runs the
        ops' path), forgotten here."""
        b, self._scatter_for = self._scatter_for, None
        return b

    def check(self, b: ForwardBatch, tag: int, stamp: bool, truth: bool, held: torch.Tensor | None = None) -> bool:
        """HEAD (``stamp``, with the idle cached slots ``held``) or TAIL of ``b``, after ``b``'s
        deferred truth scatter when there is one. False (nothing written): the caller makes the
        deferred scatter (``take_scatter``), then runs the ops."""
        arrays = self._arrays_of(b)
        if arrays is None:
            return False
        if held is not None:
            if held.dtype != torch.int64 or held.dim() != 1 or held.device.type != "cpu":
                return False
            held = held.numpy()
        pending = self._scatter_for
        scatter = None
        if pending is b:
            try:
                scatter = (b.truth_ids.numpy(), b.truth_offsets.numpy(),
                           None if b.truth_starts is None else b.truth_starts.numpy())
            except (TypeError, RuntimeError):
                return False
        elif pending is not None:  # another batch's: its rows are rewritten by any batch that reads them
            self._scatter_for = None
        if not self.bound.check(arrays, held, tag, stamp, truth, scatter):
            return False
        if scatter is not None:
            self._scatter_for = None
        return True

    def verify(self, slot: list, pred: list, position: list, token: list, tag: int) -> bool:
        """A sweep's ``verify`` of these host-list entries, without filling the sweep plan's tensors."""
        return self.bound is not None and self.bound.verify(slot, pred, position, token, tag)
