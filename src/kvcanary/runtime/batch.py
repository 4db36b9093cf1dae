"""The integration contract: one dataclass describing a forward to the canary.

An engine builds a ``ForwardBatch`` per forward from tensors it already has. Shapes use
``bs`` for the number of requests (padding requests included) and ``T`` for the number of
tokens the forward writes (``T == extend_lens.sum()``).

| field             | dtype / shape            | meaning                                          |
|-------------------|--------------------------|--------------------------------------------------|
| req_pool_indices  | int64[bs]                | page-table row per request; row 0 = padding      |
| prefix_lens       | int64[bs]                | tokens already in the cache (read, not written)  |
| extend_lens       | int64[bs]                | tokens this forward writes (1 for decode)        |
| req_to_token      | int32[rows, max_ctx]     | page table: (row, position) -> slot              |
| input_ids         | int64[T]                 | tokens written, request after request            |
| positions         | int64[T]                 | their positions                                  |
| out_cache_loc     | int64[T]                 | slots they are written to                        |
| truth_ids         | int64[n] or None         | per request: origin + output ids so far, flat    |
| truth_offsets     | int64[bs+1] or None      | request r owns truth_ids[off[r]:off[r+1]]        |
| request_ids       | tuple of bs ids or None  | host-side ids used to name requests in reports   |
| slot_lut          | int64[num_slots] or None | sliding-window pool: full slot -> window slot,   |
|                   |                          | 0 = none (read by a Canary built with a window)  |
| truth_starts      | int64[bs] or None        | appends: request r's truth_ids are its history   |
|                   |                          | from position truth_starts[r] on (with truth)    |

Every field is checked on construction (dtype, shape, device: all tensors on ``req_to_token``'s
device) and a mismatch raises ``BatchError`` naming the field, the expected and the actual value,
before the canary touches any state. The value checks that need the data (``T ==
extend_lens.sum()``, ``truth_offsets[-1] == len(truth_ids)``, ``truth_starts >= 0``) run on CPU
tensors only: on CUDA they would stall the stream, so there the ops clamp and mask instead.

Token truth as appends (``truth_starts``): instead of every request's whole history at every
forward, a request's history is sent once (a forward without starts, or a start of 0) and each
later forward sends only the tokens from ``truth_starts[r]`` on, typically its one new token at
``prefix_lens[r]``; the canary keeps the rest in its truth table, one row per page-table row. The
positions before a start must be the ones this request's earlier forwards sent in the same row: a
row given to a new request starts again from 0 (an engine keeps, per request, how much of its
history its row holds). A decode batch of appends has fixed sizes, so on CUDA the canary appends
inside a captured graph (``Canary.launch_head``) and the host builds no scatter at all.

Ownership: the canary only reads these tensors and keeps a reference to the batch until the
step's report (it names requests from it), so an engine may refill them in place for the next
step (CUDA graphs do) but must not free them before ``end_step``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.errors import KVCanaryError


class BatchError(KVCanaryError, ValueError):
    """A ForwardBatch field has the wrong dtype, shape, device or length."""


_HINT = {
    "req_pool_indices": "one page-table row per request",
    "prefix_lens": "one per request",
    "extend_lens": "one per request",
    "input_ids": "one per token written",
    "positions": "one per token written",
    "out_cache_loc": "one per token written",
    "truth_offsets": "build it with kvcanary.ops.offsets_from_lengths(lengths)",
    "truth_starts": "one start position per request",
}


@dataclass(frozen=True)
class ForwardBatch:
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    req_to_token: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    truth_ids: torch.Tensor | None = None
    truth_offsets: torch.Tensor | None = None
    request_ids: tuple | None = None
    slot_lut: torch.Tensor | None = None
    truth_starts: torch.Tensor | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (see the module table); raises BatchError naming the first bad one."""
        rtt = _tensor("req_to_token", self.req_to_token, torch.int32, 2)
        device = rtt.device
        bs = _tensor("req_pool_indices", self.req_pool_indices, torch.int64, 1, device=device).shape[0]
        for name in ("prefix_lens", "extend_lens"):
            _tensor(name, getattr(self, name), torch.int64, 1, device=device, length=(bs, "bs"))
        num_tokens = _tensor("input_ids", self.input_ids, torch.int64, 1, device=device).shape[0]
        for name in ("positions", "out_cache_loc"):
            _tensor(name, getattr(self, name), torch.int64, 1, device=device, length=(num_tokens, "len(input_ids)"))
        if (self.truth_ids is None) != (self.truth_offsets is None):
            given, missing = ("truth_ids", "truth_offsets") if self.truth_offsets is None else \
                ("truth_offsets", "truth_ids")
            raise BatchError(f"ForwardBatch.{given} is given but {missing} is None; pass both or neither")
        if self.truth_ids is not None:
            _tensor("truth_ids", self.truth_ids, torch.int64, 1, device=device)
            _tensor("truth_offsets", self.truth_offsets, torch.int64, 1, device=device, length=(bs + 1, "bs+1"))
        if self.truth_starts is not None:
            if self.truth_ids is None:
                raise BatchError("ForwardBatch.truth_starts is given but truth_ids is None; appends need the ids "
                                 "they append (or pass no truth at all)")
            _tensor("truth_starts", self.truth_starts, torch.int64, 1, device=device, length=(bs, "bs"))
        if self.slot_lut is not None:
            _tensor("slot_lut", self.slot_lut, torch.int64, 1, device=device)
        if self.request_ids is not None:
            if not isinstance(self.request_ids, tuple):
                raise BatchError(f"ForwardBatch.request_ids must be a tuple (one id per request, None for "
                                 f"padding), got {type(self.request_ids).__name__}")
            if len(self.request_ids) != bs:
                raise BatchError(f"ForwardBatch.request_ids length {len(self.request_ids)} != bs ({bs}); "
                                 "one id per request, None for padding")
        if device.type == "cpu":  # value checks: free on the host, a stall on a device
            total = int(self.extend_lens.sum())
            if total != num_tokens:
                raise BatchError(f"ForwardBatch.extend_lens sums to {total} != len(input_ids) ({num_tokens}); "
                                 "a forward writes extend_lens[r] tokens for request r")
            if self.truth_offsets is not None:
                end, n = int(self.truth_offsets[-1]), self.truth_ids.shape[0]
                if int(self.truth_offsets[0]) != 0 or end != n:
                    raise BatchError(f"ForwardBatch.truth_offsets must run from 0 to len(truth_ids) ({n}), got "
                                     f"{int(self.truth_offsets[0])}..{end}; {_HINT['truth_offsets']}")
            if self.truth_starts is not None and bs and int(self.truth_starts.min()) < 0:
                i = int(torch.nonzero(self.truth_starts < 0)[0])
                raise BatchError(f"ForwardBatch.truth_starts[{i}] = {int(self.truth_starts[i])} < 0; an append "
                                 "starts at a position >= 0 of its request's history")

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _tensor(name: str, value, dtype: torch.dtype, dim: int, device: torch.device | None = None,
            length: tuple[int, str] | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"ForwardBatch.{name} must be a torch.Tensor ({dtype}), got {type(value).__name__}")
    if value.dtype != dtype:
        raise BatchError(f"ForwardBatch.{name} dtype {value.dtype} != {dtype}; convert it with .to({dtype})")
    if value.dim() != dim:
        shape = "[rows, max_ctx]" if dim == 2 else "[n]"
        raise BatchError(f"ForwardBatch.{name} has {value.dim()} dims (shape {list(value.shape)}) != {dim}; "
                         f"expected {dtype}{shape}")
    if device is not None and value.device != device:
        raise BatchError(f"ForwardBatch.{name} is on {value.device} != req_to_token's device ({device}); "
                         "every tensor of a batch lives on the pool's device")
    if length is not None and value.shape[0] != length[0]:
        hint = _HINT.get(name, "")
        raise BatchError(f"ForwardBatch.{name} length {value.shape[0]} != {length[1]} ({length[0]})"
                         + (f"; {hint}" if hint else ""))
    return value
