"""The options the commands share, as ``Annotated`` types (``opt.Seed``, ``opt.Model``, ...).

Parsing imports nothing heavy, so ``--help`` and a bad option answer at once: the choices below
mirror the enums of the layers under the command line (``Policy``, ``FingerprintMode``,
``ModelPreset``, ``DeviceName``, ``EngineKind``) and ``RUN`` / ``DEMO`` / ``SOAK`` mirror the
defaults of the frozen options of ``kvcanary.runs.setup`` (tests/e2e/test_cli_edges.py pins both
equal). A command converts its choices to those types when it runs (``canary_options``,
``model_preset``, ...), and only then imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated

import typer


class PolicyChoice(str, enum.Enum):
    OFF = "off"
    LOG = "log"
    RAISE = "raise"
    RECOMPUTE = "recompute"


class RealKvChoice(str, enum.Enum):
    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"


class ModelChoice(str, enum.Enum):
    TINY = "tiny"
    SMALL = "small"
    HYBRID_SWA = "hybrid-swa"


class DeviceChoice(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class EngineChoice(str, enum.Enum):
    REFERENCE = "reference"
    TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class Defaults:
    """What a command does when an option is left out."""

    requests: int = 128
    max_new_tokens: int = 16
    seed: int = 0
    model: ModelChoice = ModelChoice.TINY
    device: DeviceChoice = DeviceChoice.CPU
    policy: PolicyChoice = PolicyChoice.LOG
    real_kv: RealKvChoice = RealKvChoice.PARTIAL
    sweep_interval: int = 8
    sweep_budget: int = 1 << 20
    truth: bool = True
    stats_period: int = 0
    fault_warmup: int = 24
    engine: EngineChoice = EngineChoice.REFERENCE
    tp: int = 1
    pd: bool = False


RUN = Defaults()
DEMO = Defaults(requests=96, sweep_interval=4)
DEMO_ZOO_REQUESTS, DEMO_PD_WARMUP = 32, 8
SOAK = Defaults(real_kv=RealKvChoice.ALL, sweep_interval=4)
SOAK_TOKENS = 40_000
ALL = "all"  # every kind, in a list option


def choice(kind: type[enum.Enum]):
    """A parser for ``kind``'s values whose error is one plain sentence listing them."""
    names = ", ".join(str(m.value) for m in kind)

    def parse(value: enum.Enum | str) -> enum.Enum:
        if isinstance(value, kind):
            return value
        try:
            return kind(str(value).lower())
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not one of {names}") from None

    return parse


def _choice_option(name: str, kind: type[enum.Enum], help: str):
    return typer.Option(name, parser=choice(kind), metavar="<" + "|".join(str(m.value) for m in kind) + ">",
                        help=help)


def split_kinds(values: list[str] | None) -> list[str]:
    """The kinds a repeatable, comma-separated option names (``--faults a,b --faults c``)."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


Requests = Annotated[int, typer.Option("--requests", min=1, help="Requests of the built-in workload.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens each request generates.")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seed of the workload, the model weights and the faults.")]
Model = Annotated[ModelChoice, _choice_option("--model", ModelChoice, "tiny: hidden 64, 2 layers; small: hidden "
                                              "256, 4 layers; hybrid-swa: tiny with 4 layers, 2 of them over a "
                                              "sliding window of 8.")]
Device = Annotated[DeviceChoice, _choice_option("--device", DeviceChoice, "Where the engine and the canary run.")]
PolicyOption = Annotated[PolicyChoice, _choice_option("--policy", PolicyChoice, "off: no checks; log: report and keep "
                                                      "serving; raise: fail the requests that read the damage; "
                                                      "recompute: re-prefill the requests. Except off, damaged "
                                                      "slots leave the prefix cache (quarantine).")]
RealKv = Annotated[RealKvChoice, _choice_option("--real-kv", RealKvChoice, "Fingerprint of the real K/V bytes: none, "
                                                "the first 16 bytes of each row, or all of it.")]
Engine = Annotated[EngineChoice, _choice_option("--engine", EngineChoice, "reference: the embedded engine; "
                                                "transformers: Hugging Face transformers continuous batching with a "
                                                "tiny random Llama (kvcanary.adapters.transformers).")]
SweepInterval = Annotated[int, typer.Option("--sweep-interval", min=0, help="Steps between sweeps of idle "
                                            "prefix-cache slots (0 = never).")]
SweepBudget = Annotated[int, typer.Option("--sweep-budget", min=1, help="Bytes one sweep may read.")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="torch intra-op threads (default: 1 for "
                                             "tiny and hybrid-swa, whose small matmuls lose to thread barriers; 2 for "
                                             "small).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every violation and fault line.")]


def set_threads(threads: int | None, model: ModelChoice) -> None:
    import torch

    is_tiny = model in (ModelChoice.TINY, ModelChoice.HYBRID_SWA)
    torch.set_num_threads(threads or (1 if is_tiny else min(2, torch.get_num_threads())))


def model_preset(model: ModelChoice):
    from kvcanary.runs.setup import ModelPreset

    return ModelPreset(model.value)


def device_name(device: DeviceChoice):
    from kvcanary.runs.setup import DeviceName

    return DeviceName(device.value)


def engine_kind(engine: EngineChoice):
    from kvcanary.runs.setup import EngineKind

    return EngineKind(engine.value)


def canary_options(policy: PolicyChoice, real_kv: RealKvChoice, sweep_interval: int, sweep_budget: int,
                   truth: bool = True, stats_period: int = 0):
    """The ``CanaryOptions`` of the chosen values."""
    from kvcanary.config import Policy
    from kvcanary.ops.fingerprint import FingerprintMode
    from kvcanary.runs.setup import CanaryOptions

    return CanaryOptions(policy=Policy(policy.value), real_kv=FingerprintMode[real_kv.name],
                         sweep_interval=sweep_interval, sweep_budget=sweep_budget, truth=truth,
                         stats_period=stats_period)
