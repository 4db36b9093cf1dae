"""Attach a canary to Hugging Face transformers continuous batching (``generate_batch``, the manager API).

    from kvcanary.adapters.transformers import install
    kv = install(model, CanaryConfig())         # or install(manager, ...); also a context manager
    outputs = model.generate_batch(prompts, generation_config=gen)
    kv.flush(); kv.violations                   # every violation reported, by reason and launch point

Each ``ContinuousBatchProcessor`` a registered model or manager creates gets its own Canary over
the processor's real paged cache (see ``_hf_attachment`` for the hooks). The only class-level
patch is ``ContinuousBatchingManager._create_batch_processor``, which hands new processors to the
adapter; it is undone when the last installation is removed. The installed transformers version
is checked at install: versions outside ``SUPPORTED`` are refused unless ``force=True``.
"""

from __future__ import annotations

import logging
from collections import Counter

from kvcanary.adapters._hf_attachment import AdapterStats, Attachment, StepHook
from kvcanary.config import CanaryConfig, Policy
from kvcanary.errors import ConfigError
from kvcanary.runtime.reporting import Violation

log = logging.getLogger("kvcanary")

SUPPORTED = ((5, 17), (5, 24))  # inclusive minor range; tested on 5.17 and 5.24
SUPPORTED_TEXT = "transformers>=5.17,<5.25"


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or -1)
    except (IndexError, ValueError):
        return (-1, -1)


def installed_version() -> str:
    """The version of the transformers package that ``import transformers`` loads."""
    try:
        import transformers
    except ImportError as e:
        raise ConfigError("the transformers adapter needs transformers: pip install 'kv-canary[transformers]'") from e
    return transformers.__version__


def check_version(force: bool = False) -> str:
    """The installed transformers version; raises ConfigError outside ``SUPPORTED`` unless ``force``."""
    version = installed_version()
    if not SUPPORTED[0] <= _minor(version) <= SUPPORTED[1]:
        msg = (f"transformers {version} is installed, but the adapter was tested with {SUPPORTED_TEXT} only; "
               "its continuous-batching internals may differ. Install a supported version, or pass force=True "
               "to try anyway")
        if not force:
            raise ConfigError(msg)
        log.warning("%s (forced)", msg)
    return version


def page_size_option(page_size: int) -> dict:
    """The ``ContinuousBatchingConfig`` keyword for tokens per page: ``page_size`` (5.24) or ``block_size`` (5.17)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    return {"page_size" if "page_size" in fields else "block_size": page_size}


class TransformersCanary:
    """The installation: one Attachment (canary) per batch processor of the registered target."""

    def __init__(self, target, config: CanaryConfig, max_ctx: int | None, version: str):
        self.target, self.config, self.max_ctx, self.version = target, config, max_ctx, version
        self.attachments: list[Attachment] = []
        self.step_hooks: list[StepHook] = []  # called before each step: fn(attachment, step); used by fault tests

    def attach(self, processor) -> Attachment:
        for a in self.attachments:
            if a.processor is processor:
                return a
        max_ctx = self.max_ctx or getattr(processor.config, "max_position_embeddings", None) or 4096
        a = Attachment(processor, self.config, int(max_ctx), self.step_hooks)
        self.attachments.append(a)
        return a

    @property
    def canary(self):
        """The canary of the latest batch processor (None before the first one exists)."""
        return self.attachments[-1].canary if self.attachments else None

    def flush(self) -> list[Violation]:
        """Collect everything still pending on the device (call after generation ended); returns it."""
        return [v for a in self.attachments for v in a.flush().violations]

    @property
    def error(self) -> str | None:
        """Why the raise policy (or the watchdog) stopped a generation run, if it did."""
        return next((a.error for a in self.attachments if a.error), None)

    @property
    def violations(self) -> list[Violation]:
        return [v for a in self.attachments for r in a.reports for v in r.violations]

    @property
    def alarms(self) -> list:
        return [x for a in self.attachments for r in a.reports for x in r.alarms]

    @property
    def stats(self) -> AdapterStats:
        out = AdapterStats()
        for a in self.attachments:
            for k, v in a.stats.as_dict().items():
                setattr(out, k, getattr(out, k) + v)
        return out

    def totals(self) -> dict:
        """Canary totals summed over the attachments: steps, forwards, sweeps, violations by reason and point."""
        keys = ("steps", "forwards", "sweeps", "violations", "watchdog_alarms", "seconds")
        out = {k: sum(getattr(a.canary.totals, k) for a in self.attachments) for k in keys}
        out["by_reason"] = sum((a.canary.totals.by_reason for a in self.attachments), Counter())
        out["by_launch_point"] = sum((a.canary.totals.by_launch_point for a in self.attachments), Counter())
        return out

    def uninstall(self) -> None:
        """Detach from every processor and unregister the target (idempotent)."""
        for a in self.attachments:
            a.detach()
        _unregister(self)

    def __enter__(self) -> TransformersCanary:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


_REGISTRY: dict[int, TransformersCanary] = {}
_ORIGINAL_CREATE = None


def _create_batch_processor(manager):
    handle = _REGISTRY.get(id(manager)) or _REGISTRY.get(id(getattr(manager, "model", None)))
    cb = getattr(manager, "continuous_batching_config", None)
    if handle is not None and getattr(cb, "use_async_batching", False):
        log.warning("kv-canary: turning transformers' async batching off: it prepares the next batch while a "
                    "forward runs, which per-forward checks cannot follow")
        cb.use_async_batching = False
    processor = _ORIGINAL_CREATE(manager)
    if handle is not None:
        handle.attach(processor)
    return processor


def _manager_class():
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    return ContinuousBatchingManager


def _unregister(handle: TransformersCanary) -> None:
    global _ORIGINAL_CREATE
    key = id(handle.target)
    if _REGISTRY.get(key) is handle:
        del _REGISTRY[key]
    if not _REGISTRY and _ORIGINAL_CREATE is not None:
        _manager_class()._create_batch_processor = _ORIGINAL_CREATE
        _ORIGINAL_CREATE = None


def install(target, config: CanaryConfig | None = None, *, force: bool = False,
            max_ctx: int | None = None) -> TransformersCanary:
    """Attach a canary to every continuous-batching run of ``target`` (a model with ``generate_batch``
    or a ``ContinuousBatchingManager``; a manager that already runs is attached at once).

    ``max_ctx``: the longest request (prompt + output) the canary's page table holds (default: the
    model's ``max_position_embeddings``). Raises ConfigError for an untested transformers version
    (unless ``force``), a second installation on the same target, or the recompute policy (the
    adapter cannot re-prefill requests inside transformers; use log or raise)."""
    global _ORIGINAL_CREATE
    config = config or CanaryConfig()
    if not isinstance(config, CanaryConfig):
        raise ConfigError(f"config must be a CanaryConfig, got {type(config).__name__}")
    if config.policy is Policy.RECOMPUTE:
        raise ConfigError("Policy.RECOMPUTE is not supported by the transformers adapter; use Policy.LOG or "
                          "Policy.RAISE")
    if max_ctx is not None and max_ctx < 1:
        raise ConfigError(f"max_ctx must be >= 1, got {max_ctx}")
    version = check_version(force)
    cls = _manager_class()
    is_manager = isinstance(target, cls)
    if not is_manager and not hasattr(target, "generate_batch"):
        raise ConfigError(f"target must be a transformers model with generate_batch or a ContinuousBatchingManager, "
                          f"got {type(target).__name__}")
    if id(target) in _REGISTRY:
        raise ConfigError(f"a canary is already installed on this {type(target).__name__}; uninstall() it first")
    handle = TransformersCanary(target, config, max_ctx, version)
    _REGISTRY[id(target)] = handle
    if _ORIGINAL_CREATE is None:
        _ORIGINAL_CREATE = cls._create_batch_processor
        cls._create_batch_processor = _create_batch_processor
    running = getattr(target, "batch_processor", None) if is_manager else None
    if running is not None:
        handle.attach(running)
    return handle
