"""kv-canary for vLLM v1: a KV connector plugin, nothing of vLLM forked (install ``kv-canary[vllm]``).

Offline::

    from vllm import LLM
    from kvcanary.adapters.vllm import kv_transfer_config
    llm = LLM(model=..., enable_prefix_caching=True, kv_transfer_config=kv_transfer_config(policy="log"))

Serving (the ``vllm.general_plugins`` entry point registers the connector's name in every process)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVCanaryConnector", "kv_role": "kv_both"}'

``kv_transfer_config(**settings)`` validates the settings (``settings.AdapterSettings``) and
returns the dict vLLM takes, with ``kv_load_failure_policy`` matching the policy. docs/vllm.md
says what is covered, how violations read and what each policy does inside vLLM.
"""

from __future__ import annotations

from kvcanary.adapters.vllm.settings import FAILURE_POLICY, AdapterSettings

CONNECTOR = "KVCanaryConnector"
MODULE = "kvcanary.adapters.vllm.connector"

__all__ = ["CONNECTOR", "AdapterSettings", "kv_transfer_config", "register"]


def kv_transfer_config(**settings) -> dict:
    """vLLM's ``kv_transfer_config`` turning the canary on (keys: see ``AdapterSettings``)."""
    s = AdapterSettings.from_extra_config(settings)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": FAILURE_POLICY.get(s.policy, "fail"),
            "kv_connector_extra_config": s.to_extra_config()}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: the connector known by name in every vLLM process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, "KVCanaryConnector")
