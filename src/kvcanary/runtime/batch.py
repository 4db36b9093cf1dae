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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
