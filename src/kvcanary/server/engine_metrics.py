"""The served engine's metrics, named as vLLM names them, under our prefix.

| metric                                     | type      | vLLM's                                  |
|--------------------------------------------|-----------|-----------------------------------------|
| kvcanary_num_requests_running              | gauge     | vllm:num_requests_running               |
| kvcanary_num_requests_waiting              | gauge     | vllm:num_requests_waiting               |
| kvcanary_prompt_tokens_total               | counter   | vllm:prompt_tokens_total                |
| kvcanary_generation_tokens_total           | counter   | vllm:generation_tokens_total            |
| kvcanary_request_success_total{finished_reason} | counter | vllm:request_success_total          |
| kvcanary_time_to_first_token_seconds       | histogram | vllm:time_to_first_token_seconds        |
| kvcanary_e2e_request_latency_seconds       | histogram | vllm:e2e_request_latency_seconds        |

Times run from the moment a request was queued. ``finished_reason`` is ``length``, ``stop`` (a
stop string), ``abort`` or ``error`` (failed for reading damaged K/V under the raise policy).
The gauges are read at scrape time, which runs on the engine thread (between steps).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.engine.engine import Engine

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class EngineMetrics(Collector):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.prompt_tokens = Counter("kvcanary_prompt_tokens", "Prompt tokens queued.", registry=None)
        self.generation_tokens = Counter("kvcanary_generation_tokens", "Tokens generated and delivered.",
                                         registry=None)
        self.request_success = Counter("kvcanary_request_success", "Requests that left the engine, by how.",
                                       ["finished_reason"], registry=None)
        for reason in ("length", "stop", "abort", "error"):
            self.request_success.labels(reason)
        self.ttft = Histogram("kvcanary_time_to_first_token_seconds", "Time to first token, from queueing.",
                              buckets=TTFT_BUCKETS, registry=None)
        self.e2e = Histogram("kvcanary_e2e_request_latency_seconds", "End-to-end request latency, from queueing.",
                             buckets=E2E_BUCKETS, registry=None)

    def finished(self, gen, status: str, reason: str = "length") -> None:
        """Account a generation (a ``server.service.Generation``) that left the engine: ``status``
        ``finished`` (``reason``: its finish reason, ``length`` or ``stop``), ``aborted`` or
        ``failed``."""
        label = {"finished": reason, "aborted": "abort", "failed": "error"}[status]
        self.request_success.labels(label).inc()
        if status == "finished":
            if gen.first_token_at is not None:
                self.ttft.observe(gen.first_token_at - gen.created)
            self.e2e.observe((gen.finished_at or gen.created) - gen.created)

    def describe(self) -> Iterator[Metric]:
        return self._families(0, 0)

    def collect(self) -> Iterator[Metric]:
        sched = self.engine.scheduler
        return self._families(len(sched.running), len(sched.waiting))

    def _families(self, running: int, waiting: int) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvcanary_num_requests_running", "Requests in the engine's running batch.",
                                value=running)
        yield GaugeMetricFamily("kvcanary_num_requests_waiting", "Requests waiting to be scheduled.", value=waiting)
        for m in (self.prompt_tokens, self.generation_tokens, self.request_success, self.ttft, self.e2e):
            yield from m.collect()
