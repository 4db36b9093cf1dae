"""``KVCanaryConnector``: the adapter as a vLLM v1 KV connector (vLLM's own extension point).

vLLM builds one connector with the scheduler role in the engine-core process and one with the
worker role in every worker. The hooks the adapter uses, and what it does there:

| vLLM hook (side)                          | the adapter                                            |
|-------------------------------------------|--------------------------------------------------------|
| ``__init__`` (both)                       | checks the version and the configuration, or refuses   |
| ``on_new_request`` (scheduler)            | keeps the request (its token ids are the truth)        |
| ``build_connector_meta`` (scheduler)      | the step's ``StepMessage``                             |
| ``request_finished`` (scheduler)          | remembers its cached blocks for sweeps, frees its row  |
| ``update_connector_output`` (scheduler)   | quarantine: damaged blocks leave the prefix cache      |
| ``register_kv_caches`` (worker)           | one Canary per KV cache group over the real caches     |
| ``bind_connector_metadata`` (worker)      | takes the step's message; the forward hook runs HEAD,  |
|                                           | the model and TAIL (``install``)                       |
| ``get_block_ids_with_load_errors`` (worker)| under raise/recompute: the damaged blocks, handed to  |
|                                           | vLLM's recovery of bad blocks (fail or rewind)         |
| ``build_connector_worker_meta`` (worker)  | the ``WorkerReport`` for the scheduler                 |
| ``get_kv_connector_stats`` (worker)       | counters for vLLM's ``/metrics`` (``kvcanary_*``)      |

It loads no KV from outside (``get_num_new_matched_tokens`` is 0) and saves none.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvcanary.adapters.vllm import install as hook
from kvcanary.adapters.vllm.checks import check_config, group_specs, layout_of, model_identity
from kvcanary.adapters.vllm.messages import CanaryStats, StepMessage, layout_words
from kvcanary.adapters.vllm.metrics import CanaryPromMetrics
from kvcanary.adapters.vllm.scheduler_side import SchedulerSide
from kvcanary.adapters.vllm.settings import AdapterSettings
from kvcanary.adapters.vllm.worker_side import WorkerSide
from kvcanary.errors import ConfigError

log = logging.getLogger("kvcanary")


class KVCanaryConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.settings = AdapterSettings.from_extra_config(extra)
        check_config(vllm_config, kv_cache_config, self.settings, force=bool(extra.get("force", False)))
        specs = group_specs(kv_cache_config, model_identity(vllm_config)) if kv_cache_config is not None else []
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            block_sizes = [s.block_size for s in specs] or [vllm_config.cache_config.block_size]
            layout = tuple(layout_words(s.layout()) for s in specs)  # sent with every step: the workers compare it
            self.scheduler_side = SchedulerSide(self.settings, block_sizes, max_num_seqs, layout)
        else:
            if not specs:
                raise ConfigError("kv-canary: the worker's connector needs vLLM's KV cache config (vLLM 0.32 passes "
                                  "it to every connector)")
            self.worker_side = WorkerSide(self.settings, specs, layout_of(vllm_config, kv_cache_config),
                                          vllm_config.model_config.max_model_len, max_num_seqs)
            hook.install(self.worker_side)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # --- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: StepMessage) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker_side.clear()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_invalid_blocks()

    def build_connector_worker_meta(self):
        return self.worker_side.take_report()

    def get_kv_connector_stats(self):
        side = self.worker_side if self.worker_side is not None else self.scheduler_side
        return side.take_stats()

    def shutdown(self):
        if self.worker_side is not None:
            hook.uninstall(self.worker_side)

    # --- scheduler side -------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    def on_new_request(self, request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output) -> StepMessage:
        return self.scheduler_side.build(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler_side.absorb(connector_output.kv_connector_worker_meta)

    def request_finished(self, request, block_ids):
        self.scheduler_side.request_finished(request, block_ids)
        return False, None

    # --- metrics --------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return CanaryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return CanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
