"""The served engine's configuration: limits, what a violation under the raise policy does, and
the configs of the layers below, all frozen and checked when built (the CLI builds them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.server.access import AccessConfig
from kvcanary.server.admin import AdminConfig


@dataclass(frozen=True)
class ServeLimits:
    """``max_prompts``: prompts in one request; ``max_tokens``: the largest ``max_tokens``;
    ``max_queued``: generations in the engine at once (429 beyond); ``request_timeout_s``: a
    request's time limit (504, aborted); ``drain_s``: how long shutdown lets in-flight requests
    finish; ``history``: finished requests kept for the admin routes."""

    max_prompts: int = 16
    max_tokens: int = 1024
    max_queued: int = 1024
    request_timeout_s: float = 120.0
    drain_s: float = 5.0
    history: int = 1024

    def __post_init__(self):
        for name in ("max_prompts", "max_tokens", "max_queued", "history"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ServeLimits.{name} must be an int >= 1, got {value!r}")
        for name in ("request_timeout_s", "drain_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServeLimits.{name} must be > 0, got {value!r}")


class OnViolation(enum.Enum):
    """What the served engine does when the raise policy finds damage."""

    FAIL_REQUESTS = "fail-requests"  # the requests that read it end with an error; the rest are served
    STOP = "stop"  # fail-stop: the engine stops stepping; every request gets 503 until a restart


@dataclass(frozen=True)
class ServeConfig:
    """The served engine: model, engine and canary configs, admin and access options, limits,
    the model name clients send, and what a violation under the raise policy does
    (``on_violation``; ``STOP`` needs the raise policy)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_slots=2048, max_ctx=512,
                                                                      chunk_size=64, host_tier_slots=1024))
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    limits: ServeLimits = field(default_factory=ServeLimits)
    model_name: str = "kv-canary-reference"
    on_violation: OnViolation = OnViolation.FAIL_REQUESTS

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("ServeConfig.model_name must be a non-empty string, got ''")
        if not isinstance(self.on_violation, OnViolation):
            choices = ", ".join(repr(o.value) for o in OnViolation)
            if self.on_violation not in {o.value for o in OnViolation}:
                raise ValueError(f"ServeConfig.on_violation must be one of {choices}, got {self.on_violation!r}")
            object.__setattr__(self, "on_violation", OnViolation(self.on_violation))
        if self.on_violation is OnViolation.STOP and self.canary.policy is not Policy.RAISE:
            raise ValueError(f"ServeConfig.on_violation 'stop' acts under the raise policy only, got policy "
                             f"{self.canary.policy.value!r}; pass policy 'raise' (--policy raise) or drop it")
