"""DeviceState: every buffer the ops write besides the KV pool, as one validated object.

| field        | dtype / shape                    | meaning                                          |
|--------------|----------------------------------|--------------------------------------------------|
| records      | uint8[num_slots, 32]             | canary records, index-aligned with the pool      |
| ring         | int64[capacity, 8]               | violation rows (core.record layout)              |
| ring_counter | int64[1]                         | rows ever appended (rows past capacity dropped)  |
| stats        | int64[NUM_LAUNCH_TAGS, NUM_STATS]| launches, slots checked, slots stamped per tag   |
| error        | int32[1]                         | device error flags (``DeviceFlag``), OR-ed in    |
| workspaces   | () or (HEAD, TAIL) ``Workspace`` | scratch of ``check_forward``, one per launch point |
| source_tags  | int64[num_slots]                 | per slot, 16 bits of each source's fingerprint part (core.record) |

The runtime allocates one per pool (``DeviceState.allocate``); tests and benchmarks may build one
from their own tensors (``DeviceState(records, ring, ring_counter, stats)``; ``source_tags`` is
then allocated zeroed). The constructor
validates every buffer once (dtype, shape, contiguity, device, no two buffers sharing bytes);
each op then calls ``check()``, which only compares the buffers' addresses and shapes with
those seen at construction, so the hot path stays cheap. Kernels never raise: a wait that hit
its cap or a ticket out of range (a stale workspace) and device-side bad offsets set bits of
``error``, which the runtime reports.

``allocate`` lays ``ring_counter``, ``stats`` and ``error`` out back to back in one int64
block (``counter_block()``), so the runtime snapshots all three with a single copy per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS, RECORD_BYTES, VIOLATION_ROW_WIDTH, LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import (
    cdiv,
    changed_buffers,
    check_aligned,
    check_buffers,
    check_count,
    check_tensor,
    layout_key,
)

# tokens per look-back block of check_forward's writers: 256 (one a thread with HEAD's 8 warps) keeps
# HEAD's kernel at 80 registers, against 222 at 1024, which left one block an SM for its verifiers too
# (benchmarks/bench_head.py on an H200: a decode HEAD 23-45 % faster, a 16k prefill's the same)
WRITE_BLOCK = 256


class DeviceFlag(enum.IntFlag):
    """Bits of ``DeviceState.error``."""

    OFFSETS = 1  # scatter: device offsets that do not start at 0, decrease or miss the end
    ROWS = 2  # scatter: a device row index outside the table
    WORKSPACE = 4  # check_forward: a ticket out of range or a wait that hit its cap (stale workspace)

    @classmethod
    def names(cls, bits: int) -> list[str]:
        return [f.name.lower() for f in cls if bits & f.value] + ([f"unknown_{bits & ~15:#x}"] if bits & ~15 else [])


@dataclass(frozen=True, eq=False)
class Workspace:
    """Device scratch of ``check_forward``'s kernel: launch sync words, write offsets and seeds,
    and the look-back state of up to ``max_tokens`` written tokens. Allocate once, outside any
    CUDA-graph capture."""

    sync: torch.Tensor  # int64[4]: ticket, pre-phase done (2**32 ticket 0, 1 a verifier), finished, epoch
    write_offsets: torch.Tensor  # int64[max_bs + 1]
    seed: torch.Tensor  # int64[max_bs]
    block_sum: torch.Tensor  # int64[2 * max_blocks]: per write block, its aggregate and its inclusive sum
    block_flag: torch.Tensor  # int64[max_blocks]: 4 * epoch + (1 agg, 2 agg with a start, 3 inclusive), mod 2**64

    def __post_init__(self):
        fields = ("sync", "write_offsets", "seed", "block_sum", "block_flag")
        check_buffers("Workspace", self, dict.fromkeys(fields, torch.int64), {}, "")
        max_bs, blocks = self.seed.shape[0], self.block_flag.shape[0]
        if max_bs < 1 or blocks < 1:
            raise InputError(f"Workspace seed/block_flag must be non-empty, got lengths {max_bs}, {blocks}; "
                             "use Workspace.allocate")
        check_buffers("Workspace", self, {}, dict(sync=4, write_offsets=max_bs + 1, block_sum=2 * blocks),
                      f"max_bs {max_bs}, blocks {blocks}")
        for name in fields:
            check_aligned(f"Workspace.{name}", getattr(self, name), 8, "the kernel reads int64 words")
        object.__setattr__(self, "_key", layout_key(self.tensors()))

    @classmethod
    def allocate(cls, max_bs: int, max_tokens: int, device: torch.device | str = "cpu") -> Workspace:
        check_count("max_bs", max_bs)
        check_count("max_tokens", max_tokens)
        i64 = dict(dtype=torch.int64, device=device)
        blocks = cdiv(max_tokens, WRITE_BLOCK)
        return cls(torch.zeros(4, **i64), torch.zeros(max_bs + 1, **i64), torch.full((max_bs,), -1, **i64),
                   torch.zeros(2 * blocks, **i64), torch.zeros(blocks, **i64))

    def reset(self) -> None:
        """Back to the state of a fresh allocation (after a launch reported a stale workspace)."""
        for t in (self.sync, self.write_offsets, self.block_sum, self.block_flag):
            t.zero_()
        self.seed.fill_(-1)

    def set_epoch(self, epoch: int) -> None:
        """``reset``, then the launch epoch (``sync[3]``, int64, one more each launch) at ``epoch``
        (any int64: the kernel compares flags with the epoch wrap-safe). For tests that run
        launches across 2**61 (where ``4 * epoch`` wraps) or 2**63; outside any CUDA-graph capture."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not -(2**63) <= epoch < 2**63:
            raise InputError(f"epoch {epoch!r} out of range [-2**63, 2**63)")
        self.reset()
        self.sync[3] = epoch

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.sync, self.write_offsets, self.seed, self.block_sum, self.block_flag

    def check(self) -> None:
        """The per-call check: the buffers validated at construction, unchanged (``layout_key``:
        addresses, shapes, strides, dtypes, devices); a swap of two fields or a resize is refused."""
        if layout_key(self.tensors()) != self._key:
            raise InputError(f"Workspace buffers were resized or replaced since it was built "
                             "(their shape, strides, dtype, device or address changed): "
                             f"{changed_buffers(WS_FIELDS, self.tensors(), self._key)}; "
                             "allocate a new one (Workspace.allocate)")

    @property
    def max_bs(self) -> int:
        return self.seed.shape[0]

    @property
    def max_tokens(self) -> int:
        return self.block_flag.shape[0] * WRITE_BLOCK

WS_FIELDS = ("sync", "write_offsets", "seed", "block_sum", "block_flag")
COUNTER_BLOCK_WORDS = 1 + NUM_LAUNCH_TAGS * NUM_STATS + 1  # ring_counter, stats, error (one word)


STATE_FIELDS = ("records", "ring", "ring_counter", "stats", "error", "source_tags")


@dataclass(frozen=True, eq=False)
class DeviceState:
    """See the module doc. Raises InputTypeError / InputError naming the field on bad buffers."""

    records: torch.Tensor
    ring: torch.Tensor
    ring_counter: torch.Tensor
    stats: torch.Tensor
    error: torch.Tensor | None = None  # int32[1]; allocated (zeroed) when None
    workspaces: tuple[Workspace, ...] = ()  # () or (HEAD, TAIL); () makes check_forward allocate per call
    source_tags: torch.Tensor | None = None  # int64[num_slots]; allocated (zeroed) when None
    _key: tuple = field(init=False, repr=False, default=())

    def __post_init__(self):
        dev = self.records.device if isinstance(self.records, torch.Tensor) else "cpu"
        if self.error is None:
            object.__setattr__(self, "error", torch.zeros(1, dtype=torch.int32, device=dev))
        if self.source_tags is None:
            num_slots = self.records.shape[0] if isinstance(self.records, torch.Tensor) and self.records.dim() else 0
            object.__setattr__(self, "source_tags", torch.zeros(num_slots, dtype=torch.int64, device=dev))
        object.__setattr__(self, "workspaces", tuple(self.workspaces))
        self._validate()
        object.__setattr__(self, "_key", layout_key(self._tensors()[:6]))

    @classmethod
    def allocate(cls, num_slots: int, *, ring_capacity: int = 4096, max_bs: int = 1, max_tokens: int = 1,
                 device: torch.device | str = "cpu") -> DeviceState:
        """Zeroed records for ``num_slots`` slots, an empty ring of ``ring_capacity`` rows, zero
        stats and error flags, and a HEAD and a TAIL workspace for ``max_bs`` requests and
        ``max_tokens`` written tokens per forward."""
        if check_count("num_slots", num_slots) < 2:
            raise InputError(f"num_slots {num_slots} < 2; slot 0 is reserved, so a pool needs at least 2 slots")
        check_count("ring_capacity", ring_capacity)
        block = torch.zeros(COUNTER_BLOCK_WORDS, dtype=torch.int64, device=device)
        return cls(torch.zeros(num_slots, RECORD_BYTES, dtype=torch.uint8, device=device),
                   torch.full((ring_capacity, VIOLATION_ROW_WIDTH), -1, dtype=torch.int64, device=device),
                   block[:1], block[1:-1].view(NUM_LAUNCH_TAGS, NUM_STATS), block[-1:].view(torch.int32)[:1],
                   tuple(Workspace.allocate(max_bs, max_tokens, device) for _ in (LaunchPoint.HEAD, LaunchPoint.TAIL)),
                   torch.zeros(num_slots, dtype=torch.int64, device=device))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        out = (self.records, self.ring, self.ring_counter, self.stats, self.error, self.source_tags)
        for ws in self.workspaces:
            out += ws.tensors()
        return out

    def _validate(self) -> None:
        shapes = (("records", torch.uint8, (None, RECORD_BYTES), "uint8[num_slots, 32]"),
                  ("ring", torch.int64, (None, VIOLATION_ROW_WIDTH), f"int64[capacity, {VIOLATION_ROW_WIDTH}]"),
                  ("ring_counter", torch.int64, (1,), "int64[1]"),
                  ("stats", torch.int64, (NUM_LAUNCH_TAGS, NUM_STATS), f"int64[{NUM_LAUNCH_TAGS}, {NUM_STATS}]"),
                  ("error", torch.int32, (1,), "int32[1]"),
                  ("source_tags", torch.int64, (None,), "int64[num_slots]"))
        for name, dtype, shape, what in shapes:
            t = check_tensor(f"state.{name}", getattr(self, name), dtype, len(shape))
            if any(w is not None and s != w for s, w in zip(t.shape, shape, strict=True)):
                raise InputError(f"state.{name} must be {what}, got shape {tuple(t.shape)}; "
                                 "allocate with DeviceState.allocate")
            if not t.is_contiguous():
                raise InputError(f"state.{name} must be contiguous, got strides {t.stride()}; "
                                 f"pass {name}.contiguous() (the kernels write it in place)")
            if t.device != self.records.device:
                raise InputError(f"state.{name} is on {t.device} but state.records is on {self.records.device}")
            check_aligned(f"state.{name}", t, 8 if name == "records" else t.element_size(),
                          "records are read as int64 words" if name == "records" else "its own word size")
        if self.source_tags.shape[0] != self.records.shape[0]:
            raise InputError(f"state.source_tags length {self.source_tags.shape[0]} != num_slots "
                             f"({self.records.shape[0]}); one side word per record")
        if self.records.shape[0] < 2:
            raise InputError(f"state.records has {self.records.shape[0]} slots < 2; slot 0 is reserved")
        if self.ring.shape[0] < 1:
            raise InputError("state.ring has 0 rows; allocate at least one")
        if len(self.workspaces) not in (0, 2):
            raise InputError(f"state.workspaces holds {len(self.workspaces)} workspaces, expected 0 or 2 "
                             "(HEAD, TAIL)")
        for i, ws in enumerate(self.workspaces):
            if not isinstance(ws, Workspace):
                raise InputTypeError(f"state.workspaces[{i}] must be a Workspace, got {type(ws).__name__}")
            if ws.sync.device != self.records.device:
                raise InputError(f"state.workspaces[{i}] is on {ws.sync.device} but state.records is on "
                                 f"{self.records.device}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                       for i, t in enumerate(self._tensors()) if t.numel())
        reach, owner = -1, -1
        for start, end, i in spans:
            if start < reach:
                raise InputError(f"state buffers {self._name(owner)} and {self._name(i)} share memory; each buffer "
                                 "needs its own storage")
            if end > reach:
                reach, owner = end, i

    def _name(self, i: int) -> str:
        names = ["records", "ring", "ring_counter", "stats", "error", "source_tags"]
        for k in range(len(self.workspaces)):
            names += [f"workspaces[{k}].{f}" for f in ("sync", "write_offsets", "seed", "block_sum", "block_flag")]
        return names[i]

    def check(self) -> None:
        """The per-call check: the same buffers as validated at construction, unchanged
        (``layout_key``: addresses, shapes, strides, dtypes, devices). A workspace is checked
        where it is used (``workspace``; a bound launch binds its own)."""
        tensors = (self.records, self.ring, self.ring_counter, self.stats, self.error, self.source_tags)
        if layout_key(tensors) != self._key:
            raise InputError(f"state buffers were resized or replaced since the DeviceState was built "
                             "(their shape, strides, dtype, device or address changed): "
                             f"{changed_buffers(tuple(f'state.{n}' for n in STATE_FIELDS), tensors, self._key)}; "
                             "build a new DeviceState")

    @property
    def device(self) -> torch.device:
        return self.records.device

    @property
    def num_slots(self) -> int:
        return self.records.shape[0]

    @property
    def ring_capacity(self) -> int:
        return self.ring.shape[0]

    def counter_block(self) -> torch.Tensor | None:
        """The int64[COUNTER_BLOCK_WORDS] block ``ring_counter | stats | error`` (the error flags in
        the low half of the last word) when the three lie back to back in that order, as
        ``allocate`` lays them out; None for buffers built apart."""
        c, words = self.ring_counter, COUNTER_BLOCK_WORDS
        base, size, storage = c.data_ptr(), c.element_size(), c.untyped_storage()
        if (self.stats.data_ptr() != base + size or self.error.data_ptr() != base + (words - 1) * size
                or any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in (self.stats, self.error))
                or storage.nbytes() < (c.storage_offset() + words) * size):
            return None
        return c.as_strided((words,), (1,), c.storage_offset())

    def workspace(self, point: LaunchPoint) -> Workspace | None:
        """The workspace of a launch point (None without workspaces), checked (``Workspace.check``)."""
        if not self.workspaces:
            return None
        ws = self.workspaces[0 if point is LaunchPoint.HEAD else 1]
        ws.check()
        return ws


def check_state(state: object) -> DeviceState:
    """The ops' entry check: a DeviceState whose buffers are those it was built with."""
    if not isinstance(state, DeviceState):
        raise InputTypeError(f"state must be a DeviceState (DeviceState.allocate(...)), got {type(state).__name__}")
    state.check()
    return state
