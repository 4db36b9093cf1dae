"""What a run is made of, frozen: the options a user picks (``RunOptions``, ``SoakOptions``,
``DemoOptions``: their defaults are the command line's defaults) and the configs they build
(``RunSetup``: model, engine, canary, workload).

``CanaryConfig`` is built from options here only (``canary_config``). A bad option raises
``OptionError`` naming the option (``--prompts``, ``--tp``, ...), the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.workload import Workload, WorkloadConfig, builtin_workload, engine_config_for, load_prompts
from kvcanary.errors import ConfigError, KVCanaryError
from kvcanary.ops.fingerprint import FingerprintMode


class ModelPreset(str, enum.Enum):
    TINY = "tiny"
    SMALL = "small"
    HYBRID_SWA = "hybrid-swa"


MODELS = {
    ModelPreset.TINY: ModelConfig(),
    ModelPreset.SMALL: ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                   head_dim=32, intermediate=768),
    # hybrid: layers 0 and 2 attend over the last 8 positions and keep their K/V in the window pool
    ModelPreset.HYBRID_SWA: ModelConfig(num_layers=4, sliding_window=8, window_layers=(0, 2)),
}


class DeviceName(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class EngineKind(str, enum.Enum):
    REFERENCE = "reference"  # the embedded engine
    TRANSFORMERS = "transformers"  # Hugging Face transformers continuous batching


# the longest request (prompt + max_new_tokens) a run accepts: the reference engine sizes its
# page table and pool to the workload, so a larger one would run for hours instead of failing
MAX_CONTEXT = 4096


class OptionError(ConfigError):
    """A bad option: ``option`` names it as the command line spells it."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class MissingExtra(KVCanaryError):
    """What was asked for needs an optional extra that is not installed."""

    def __init__(self, extra: str, what: str):
        super().__init__(f"{what} needs the {extra} extra: pip install 'kv-canary[{extra}]'")
        self.extra = extra


@dataclass(frozen=True)
class RunSetup:
    """Everything one run builds its engine(s) and canaries from."""

    model: ModelConfig
    engine: EngineConfig
    canary: CanaryConfig
    workload: Workload


@dataclass(frozen=True)
class CanaryOptions:
    """The canary's options; ``canary_config`` turns them into the ``CanaryConfig``."""

    policy: Policy = Policy.LOG
    real_kv: FingerprintMode = FingerprintMode.PARTIAL
    sweep_interval: int = 8
    sweep_budget: int = 1 << 20
    truth: bool = True
    stats_period: int = 0


def canary_config(options: CanaryOptions) -> CanaryConfig:
    try:
        return CanaryConfig(policy=options.policy, real_kv=options.real_kv, sweep_interval=options.sweep_interval,
                            sweep_budget_bytes=options.sweep_budget, truth=options.truth,
                            stats_period=options.stats_period)
    except ConfigError as e:
        raise OptionError(str(e)) from None


@dataclass(frozen=True)
class RunOptions:
    """``kv-canary run``: the built-in workload (or ``prompts``) through one kind of run.
    ``faults``: fault kinds to inject, acting after ``fault_warmup`` steps."""

    requests: int = 128
    max_new_tokens: int = 16
    seed: int = 0
    model: ModelPreset = ModelPreset.TINY
    device: DeviceName = DeviceName.CPU
    canary: CanaryOptions = CanaryOptions()
    prompts: Path | None = None
    faults: tuple[str, ...] = ()
    fault_warmup: int = 24
    engine: EngineKind = EngineKind.REFERENCE
    tp: int = 1
    pd: bool = False

    def __post_init__(self):
        modes = [name for name, on in (("--engine transformers", self.engine is EngineKind.TRANSFORMERS),
                                       ("--tp", self.tp > 1), ("--pd", self.pd)) if on]
        if len(modes) > 1:
            raise OptionError(f"{' and '.join(modes)} cannot be combined; choose one")


@dataclass(frozen=True)
class SoakOptions:
    """``kv-canary soak``: clean, log policy, the real K/V fingerprinted whole, frequent sweeps."""

    tokens: int = 40_000
    seed: int = 0
    model: ModelPreset = ModelPreset.TINY
    device: DeviceName = DeviceName.CPU
    canary: CanaryOptions = CanaryOptions(real_kv=FingerprintMode.ALL, sweep_interval=4)


@dataclass(frozen=True)
class DemoOptions:
    """``kv-canary demo``: the fault matrix, the zoo and the split runs. ``run`` holds the workload
    and canary options of every run; ``None`` fault/bug lists mean every kind."""

    run: RunOptions = RunOptions(requests=96, canary=CanaryOptions(sweep_interval=4))
    faults: tuple[str, ...] | None = None
    bugs: tuple[str, ...] | None = None
    zoo_requests: int = 32
    window_faults: tuple[str, ...] | None = None
    pd_faults: tuple[str, ...] | None = None
    pd_warmup: int = 8


def model_config(preset: ModelPreset, seed: int) -> ModelConfig:
    return dataclasses.replace(MODELS[ModelPreset(preset)], seed=seed)


def check_device(device: DeviceName) -> str:
    if device is DeviceName.CUDA and not torch.cuda.is_available():
        raise OptionError("CUDA is not available on this machine; use --device cpu", "--device")
    return device.value


def run_setup(options: RunOptions, workload: Workload | None = None) -> RunSetup:
    """The configs of ``options``: its model preset seeded, the built-in workload (or the prompt
    file's, or ``workload``), the engine sized for it, the canary. Raises ``OptionError``."""
    device = check_device(options.device)
    model = model_config(options.model, options.seed)
    if workload is None:
        workload = _workload(options, model.vocab_size)
    longest = workload.max_request_len
    if longest > MAX_CONTEXT:
        where = "--prompts" if options.prompts is not None else "--max-new-tokens"
        raise OptionError(f"the longest request asks for {longest} tokens (prompt + max_new_tokens) > the "
                          f"context of {MAX_CONTEXT}; shorten it or lower max_new_tokens", where)
    return RunSetup(model, engine_config_for(workload, device), canary_config(options.canary), workload)


def _workload(options: RunOptions, vocab_size: int) -> Workload:
    try:
        if options.prompts is not None:
            return load_prompts(options.prompts, vocab_size)
        return builtin_workload(WorkloadConfig(num_requests=options.requests, max_new_tokens=options.max_new_tokens,
                                               seed=options.seed, vocab_size=vocab_size))
    except (ConfigError, OSError) as e:
        raise OptionError(str(e), "--prompts" if options.prompts is not None else "--requests") from None
