"""publish_counters: copy the counter block into a host-visible ring of rows from a kernel, so a
CUDA graph that holds the launch hands the host each step's counters with no host call.

| argument | dtype / shape      | meaning                                                         |
|----------|--------------------|-----------------------------------------------------------------|
| block    | int64[W]           | the words to publish (``DeviceState.counter_block()``)          |
| seq      | int64[1]           | publish counter on the block's device; incremented by each call |
| rows     | int64[K, W + 1]    | pinned host rows (CUDA) or host rows (CPU), written in place     |

Each call: ``s = seq + 1; seq = s; rows[s % K, 1:] = block; rows[s % K, 0] = s``. On CUDA the
kernel writes the row's words, then a system-scope fence, then the sequence word, so a host that
reads ``rows[k, 0] == s`` reads the whole row of publish ``s``. Nothing is validated per call: the
runtime builds the three buffers once (``Reporter``) and checks them there.
"""

from __future__ import annotations

import torch

from kvcanary.errors import InputError
from kvcanary.ops._common import check_contiguous, check_len, check_tensor, tl, triton
from kvcanary.ops.launcher import Fixed, launch


def _publish_torch(block: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor) -> None:
    seq += 1
    s = int(seq[0])
    row = rows[s % rows.shape[0]]
    row[1:] = block.to(rows.device)
    row[0] = s


@triton.jit
def _fence():
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish_row(block_ptr, seq_ptr, rows_ptr, num_rows, W: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    """s = seq + 1; row s % num_rows gets the W block words, then (after a system-scope fence in
    every thread and a barrier) its sequence word s. The block is read with atomics, at the level
    every program's atomics reach: a kernel whose last program out publishes (``check_forward``'s
    TAIL) reads what the others counted."""
    s = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, s)
    row = rows_ptr + (s % num_rows) * (W + 1)
    j = tl.arange(0, BLOCK)
    m = j < W
    tl.store(row + 1 + j, tl.atomic_add(block_ptr + j, 0, mask=m, sem="relaxed"), mask=m)
    if FENCE:
        _fence()
    tl.debug_barrier()
    if FENCE:
        _fence()
    tl.store(row, s)


@triton.jit
def _publish_kernel(block_ptr, seq_ptr, rows_ptr, num_rows, W: tl.constexpr, BLOCK: tl.constexpr,
                    FENCE: tl.constexpr):
    """One program: ``publish_row``."""
    publish_row(block_ptr, seq_ptr, rows_ptr, num_rows, W, BLOCK, FENCE)


def publish_counters(block: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, triton_path: bool) -> None:
    """Publish ``block`` into ``rows`` (see module doc); ``triton_path`` launches the kernel."""
    if triton_path:
        w = block.shape[0]
        _publish_kernel[(1,)](block, seq, rows, rows.shape[0], W=w, BLOCK=triton.next_power_of_2(w),
                              FENCE=block.is_cuda, num_warps=1)
    else:
        _publish_torch(block, seq, rows)


def validate_publication(block: torch.Tensor | None, seq: object, rows: object) -> None:
    """Raises InputTypeError / InputError naming the argument where ``seq`` and ``rows`` cannot
    carry publications of ``block`` (a state's ``counter_block()``; None where its counter, stats
    and error words lie apart): ``seq`` int64[1] on the block's device, ``rows`` a contiguous
    int64[K >= 1, len(block) + 1] on the host (pinned, for a block on CUDA) or on the block's device."""
    if block is None:
        raise InputError("publication needs the state's counter block (ring_counter, stats and error back to "
                         "back, as DeviceState.allocate lays them out); this state's lie apart")
    seq = check_tensor("publication seq", seq, torch.int64, 1)
    check_len("publication seq", seq, 1, "one sequence word")
    if seq.device != block.device:
        raise InputError(f"publication seq is on {seq.device} but the counter block is on {block.device}")
    rows = check_tensor("publication rows", rows, torch.int64, 2)
    width = block.shape[0] + 1
    if rows.shape[0] < 1 or rows.shape[1] != width:
        raise InputError(f"publication rows must be int64[K >= 1, {width}] (a sequence word, then the "
                         f"{width - 1} block words), got shape {tuple(rows.shape)}")
    check_contiguous("publication rows", rows)
    if rows.device != block.device and not (rows.device.type == "cpu" and block.is_cuda and rows.is_pinned()):
        raise InputError(f"publication rows are on {rows.device} (pinned: {rows.is_pinned()}) but must be on "
                         f"{block.device} or, for a block on CUDA, in pinned host memory")


class BoundPublish:
    """``publish_counters(block, seq, rows, triton_path=True)`` with its three buffers keyed once
    (``ops.launcher``): a call is one launch through the kept compiled kernel, where Triton's own
    launch binds the arguments every time (an eager step publishes this way; a graph holds the
    launch). Nothing is validated: the runtime builds the buffers (``runtime.snapshots``)."""

    def __init__(self, block: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor):
        w = block.shape[0]
        self._fixed = Fixed(_publish_kernel, (block, seq, rows, rows.shape[0]))
        self._constexprs = {"W": w, "BLOCK": triton.next_power_of_2(w), "FENCE": block.is_cuda}

    def __call__(self) -> None:
        launch(_publish_kernel, (1,), (), self._constexprs, num_warps=1, fixed=self._fixed)
