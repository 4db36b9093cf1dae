"""The adapter's counters in vLLM's own Prometheus registry (served on vLLM's ``/metrics``).

| metric                                  | labels                         | counts                               |
|-----------------------------------------|--------------------------------|--------------------------------------|
| ``kvcanary_forwards_total``             | vLLM's (model, engine)         | forwards checked (HEAD and TAIL)     |
| ``kvcanary_sweeps_total``               |                                | sweeps of idle prefix-cache blocks   |
| ``kvcanary_violations_total``           | + ``reasons``, ``launch_point``| failed checks of one slot            |
| ``kvcanary_incidents_total``            |                                | damages opened (first violations)    |
| ``kvcanary_quarantined_blocks_total``   |                                | damaged blocks evicted from the cache|
| ``kvcanary_recovered_requests_total``   |                                | requests handed to vLLM's recovery   |
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvcanary.adapters.vllm.messages import COUNTERS, CanaryStats

HELP = {
    "forwards": "Forwards checked by kv-canary (HEAD before the model writes, TAIL after).",
    "sweeps": "kv-canary sweeps of idle prefix-cache blocks.",
    "incidents": "KV damages kv-canary opened (the first violation of a damaged slot and reason).",
    "quarantined_blocks": "Damaged blocks kv-canary evicted from vLLM's prefix cache.",
    "recovered_requests": "Requests that read damage, handed to vLLM's recovery (fail or recompute).",
}


class CanaryPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {name: self._counter_cls(name=f"kvcanary_{name}", documentation=HELP[name],
                                                 labelnames=labelnames) for name in COUNTERS}
        self.violations = self._counter_cls(name="kvcanary_violations",
                                            documentation="Failed kv-canary checks of one slot at one launch point.",
                                            labelnames=labelnames + ["reasons", "launch_point"])
        for values in per_engine_labelvalues.values():  # every series exists from the start, at 0
            for counter in self.counters.values():
                counter.labels(*values)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        values = self.per_engine_labelvalues[engine_idx]
        stats = CanaryStats(data=dict(transfer_stats_data))
        for name, counter in self.counters.items():
            n = stats.data.get(name, 0)
            if n:
                counter.labels(*values).inc(n)
        for (reasons, point), n in stats.violations().items():
            self.violations.labels(*values, reasons, point).inc(n)
