"""Configurations the adapter cannot cover are refused when vLLM builds the connector (at startup),
naming the setting and what is supported; nothing is silently left unprotected."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvcanary.errors import ConfigError

from .remote import Remote, RemoteError


def _vllm_config(model, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    from kvcanary.adapters.vllm import kv_transfer_config

    kw = dict(model=str(model), enable_prefix_caching=True, block_size=32, max_model_len=512, dtype="float32",
              enforce_eager=True, kv_transfer_config=kv_transfer_config())
    kw.update(overrides)
    return EngineArgs(**kw).create_engine_config()


def _connector(config, role="scheduler"):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcanary.adapters.vllm.connector import KVCanaryConnector

    return KVCanaryConnector(config, KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER)


def test_the_plugin_entry_point_names_the_connector_in_every_process():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert KVConnectorFactory.get_connector_class(SimpleNamespace(
        kv_connector="KVCanaryConnector", kv_connector_module_path=None)).__name__ == "KVCanaryConnector"


def test_a_supported_config_builds(tiny_llama):
    connector = _connector(_vllm_config(tiny_llama))
    assert connector.scheduler_side is not None and connector.settings.policy.value == "log"


def test_policy_and_vllm_failure_policy_must_agree(tiny_llama):
    config = _vllm_config(tiny_llama, kv_transfer_config={
        "kv_connector": "KVCanaryConnector", "kv_connector_module_path": "kvcanary.adapters.vllm.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"policy": "recompute"}})
    with pytest.raises(ConfigError, match=r"policy=recompute needs kv_transfer_config.kv_load_failure_policy="
                                          r"'recompute', got 'fail'"):
        _connector(config)


def test_unknown_setting_is_named(tiny_llama):
    config = _vllm_config(tiny_llama)
    config.kv_transfer_config.kv_connector_extra_config["sweep_intervall"] = 4
    with pytest.raises(ConfigError, match=r"unknown kv-canary keys \['sweep_intervall'\]"):
        _connector(config)


@pytest.mark.parametrize("change,message", [
    (dict(cache_config=dict(cache_dtype="fp8_e4m3")), r"kv_cache_dtype=fp8_e4m3 is not supported"),
    (dict(model_config=dict(use_mla=True)), r"MLA .* is not supported"),
    (dict(speculative_config=object()), r"speculative decoding is not supported"),
    (dict(parallel_config=dict(pipeline_parallel_size=2)), r"pipeline_parallel_size > 1 is not supported"),
])
def test_unsupported_engine_settings_are_refused(tiny_llama, change, message):
    from kvcanary.adapters.vllm.checks import check_config
    from kvcanary.adapters.vllm.settings import AdapterSettings

    real = _vllm_config(tiny_llama)
    fake = SimpleNamespace(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})
    for name, value in change.items():
        if name == "model_config":  # use_mla is a property of the real one
            value = SimpleNamespace(use_mla=value["use_mla"])
        elif isinstance(value, dict):
            value = SimpleNamespace(**{**vars(getattr(real, name)), **value})
        setattr(fake, name, value)
    with pytest.raises(ConfigError, match=message):
        check_config(fake, None, AdapterSettings())


def test_unsupported_vllm_version_is_refused_unless_forced():
    from kvcanary.adapters.vllm.checks import check_version

    with pytest.raises(ConfigError, match=r"vLLM 0.31.2 is installed, but the adapter supports vllm 0.32.x only"):
        check_version("0.31.2")
    check_version("0.31.2", force=True)
    check_version("0.32.0")


def test_a_half_the_cpu_layout_scatters_is_refused_at_startup(tiny_llama):
    with pytest.raises(RemoteError, match=r"stores \['k'\] of a token scattered over its block"):
        Remote(tiny_llama, "log", halves=["k"], real_kv="all").close()
