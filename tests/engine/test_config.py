from __future__ import annotations

import pytest
import torch

from kvcanary.engine import EngineConfig, ModelConfig, SamplerKind
from kvcanary.errors import CapacityError, ConfigError

from ._helpers import make_engine

ENGINE_ERRORS = [
    (dict(num_slots=0), "num_slots"),
    (dict(num_slots=True), "num_slots"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=4, num_slots=30), "num_slots"),
    (dict(page_size=16, num_slots=16), "num_slots"),
    (dict(max_rows=1), "max_rows"),
    (dict(max_ctx=0), "max_ctx"),
    (dict(page_size=4, max_ctx=30), "max_ctx"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(max_tokens_per_step=-3), "max_tokens_per_step"),
    (dict(max_running=0), "max_running"),
    (dict(max_running=64, max_rows=64), "max_running"),
    (dict(enable_prefix_cache=1), "enable_prefix_cache"),
    (dict(host_tier_slots=-1), "host_tier_slots"),
    (dict(host_tier_slots=8, enable_prefix_cache=False), "host_tier_slots"),
    (dict(sampler="beam"), "sampler"),
    (dict(device="tpu"), "device"),
    (dict(device=3.5), "device"),
]

MODEL_ERRORS = [
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden=-1), "hidden"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(num_heads=6, num_kv_heads=4), "num_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(intermediate=0), "intermediate"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(seed=-1), "seed"),
]


@pytest.mark.parametrize("kwargs, field", ENGINE_ERRORS)
def test_engine_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(f"EngineConfig.{field} must be "), message
    assert f"got {kwargs[field]!r}" in message and ";" in message, message  # actual value and a fix
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs, field", MODEL_ERRORS)
def test_model_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(f"ModelConfig.{field} must be "), message
    assert f"got {kwargs[field]!r}" in message and ";" in message, message


def test_configs_normalise_and_freeze():
    config = EngineConfig(sampler="oracle", device="cpu")
    assert config.sampler is SamplerKind.ORACLE and config.device == "cpu"
    assert EngineConfig(page_size=4, num_slots=64).num_usable_slots == 60
    with pytest.raises(AttributeError):
        config.page_size = 2  # type: ignore[misc]


def test_add_request_errors_name_the_argument():
    engine = make_engine(max_ctx=32, num_slots=64)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request([1, 256], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], 0)
    with pytest.raises(CapacityError, match="max_ctx"):
        engine.add_request([1] * 30, 8)
    rid = engine.add_request([1, 2], 2, request_id=7)
    with pytest.raises(ValueError, match="request_id 7"):
        engine.add_request([1, 2], 2, request_id=rid)
    with pytest.raises(ValueError, match="request_id 99"):
        engine.abort(99)
