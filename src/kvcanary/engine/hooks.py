"""The engine's instrumentation points. Subclass ``EngineHooks`` and override what you need.

Order within one ``Engine.step()``:

1. scheduling: ``before_move`` then ``on_offload`` / ``on_free`` (prefix-cache eviction),
   ``before_move`` then ``on_load`` (load-back of host-resident prefix nodes), ``on_free`` (preemption);
2. ``before_forward(batch)`` -> ``forward_prologue(batch)`` -> the model writes K/V at
   ``batch.out_cache_loc`` and reads every request's prefix through ``batch.req_to_token`` ->
   ``forward_epilogue(batch)`` -> ``after_forward(batch)``. With ``EngineConfig.cuda_graph`` the
   prologue, the model and the epilogue of a decode step are one captured CUDA graph, replayed
   after ``before_forward`` with the step's tensors copied into the graph's buffers: the prologue
   and epilogue are called once, at capture, and must only launch fixed-size device work;
3. sampling, then ``on_free`` for finished requests' slots that do not stay in the prefix cache;
4. ``after_step(step_index)``.

``Engine.abort`` and ``Engine.recompute`` run between steps and may call ``on_free``. Wherever
``on_free`` may come, ``on_retire`` may come instead for quarantined slots.
Slot tensors are int64 on the engine's device, except ``on_offload``'s and ``on_load``'s: int64 on
the CPU, as the host rows.
"""

from __future__ import annotations

import torch

from kvcanary.runtime.batch import ForwardBatch


class EngineHooks:
    """No-op hooks. Hooks must not change engine bookkeeping; they may read or write the pool.

    ``reads_token_truth``: whether these hooks read each forward's token truth
    (``ForwardBatch.truth_ids``, ``truth_offsets``, ``truth_starts``). The engine builds it only
    for hooks that do (a canary's); for any others those fields are None, so an engine without
    a canary pays nothing for a truth no one reads. Hooks that read it set it True."""

    reads_token_truth = False

    def before_forward(self, batch: ForwardBatch) -> None:
        """Right before the model runs; the slots in ``batch.out_cache_loc`` are not written yet."""

    def forward_prologue(self, batch: ForwardBatch) -> None:
        """Device work right before the model, on its stream; captured with it under CUDA graphs
        (fixed-size launches only: no host sync, no allocation, no host-side bookkeeping)."""

    def layer_done(self, batch: ForwardBatch, layer: int) -> None:
        """Device work once layer ``layer`` of the model has written and read its K/V (right after
        its attention), on the model's stream; captured with it under CUDA graphs (as the prologue)."""

    def forward_epilogue(self, batch: ForwardBatch) -> None:
        """Device work right after the model; captured with it under CUDA graphs (as the prologue)."""

    def after_forward(self, batch: ForwardBatch) -> None:
        """Right after the model wrote K/V for every slot in ``batch.out_cache_loc``."""

    def after_step(self, step_index: int) -> None:
        """Once per step that ran a forward, after sampling and finishing requests."""

    def before_move(self) -> None:
        """Right before K/V rows (and the rows of ``KVPool.move_with_kv``) are copied between the
        pool and the host tier, on the engine's stream."""

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Right after K/V of ``device_slots[i]`` was copied to host row ``host_rows[i]``, all layers
        (both int64 on the host: the slots of the device pool, as the host tier keeps them)."""

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Right after K/V of host row ``host_rows[i]`` was copied into ``device_slots[i]``, all layers
        (both int64 on the host)."""

    def on_free(self, slots: torch.Tensor) -> None:
        """Right after ``slots`` returned to the allocator (they may be handed out again)."""

    def on_retire(self, slots: torch.Tensor) -> None:
        """Right after the last holder of quarantined ``slots`` freed them: they leave service for
        good (never handed out again)."""
