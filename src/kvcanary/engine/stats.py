"""Engine counters. Token and slot counts are cumulative since the engine was built."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_steps: int = 0  # steps that ran a forward
    num_prefill_tokens: int = 0  # tokens written by prefill extends (re-prefills included)
    num_decode_tokens: int = 0  # tokens written by decode extends (one output token each)
    num_prefix_hit_tokens: int = 0  # tokens admitted from the prefix cache instead of computed
    num_evicted_slots: int = 0  # device slots released by prefix-cache eviction
    num_offloaded_slots: int = 0  # of those, copied to the host tier first
    num_loaded_slots: int = 0  # host rows loaded back into device slots
    num_dropped_host_slots: int = 0  # host rows dropped when the host tier was full
    num_preemptions: int = 0  # running requests retracted for memory
    num_aborts: int = 0
    num_recomputes: int = 0  # requests retracted by ``Engine.recompute``
    num_quarantined_slots: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
