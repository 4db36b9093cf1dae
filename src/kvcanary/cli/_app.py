"""Shared pieces of the command line: the Typer app, consoles, options, logging, run setup."""


from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import logging
import re
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for, load_prompts
from kvcanary.errors import ConfigError
from kvcanary.faults.campaign import RunSetup
from kvcanary.runtime.reporting import INCIDENTS_RE, STATS_RE, VIOLATION_RE, WATCHDOG_RE

MODELS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                         intermediate=768),
    # hybrid: layers 0 and 2 attend over the last 8 positions and keep their K/V in the window pool
    "hybrid-swa": ModelConfig(num_layers=4, sliding_window=8, window_layers=(0, 2)),
}


class ModelSize(str, enum.Enum):
    tiny = "tiny"
    small = "small"
    hybrid_swa = "hybrid-swa"


class DeviceName(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


class PolicyName(str, enum.Enum):
    off = "off"
    log = "log"
    raise_ = "raise"
    recompute = "recompute"


class RealKV(str, enum.Enum):
    none = "none"
    partial = "partial"
    all = "all"


app = typer.Typer(help="Make KV-cache corruption in LLM inference engines loud.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console()
if not console.is_terminal:
    console.width = 132  # reports piped to a file or a CI log: no need to wrap at 80 columns
err_console = Console(stderr=True)

# --- shared options ------------------------------------------------------------------------------

Requests = Annotated[int, typer.Option("--requests", min=1, help="Requests of the built-in workload.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens each request generates.")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seed of the workload, the model weights and the faults.")]
Model = Annotated[ModelSize, typer.Option("--model", help="tiny: hidden 64, 2 layers; small: hidden 256, 4 layers; "
                                      "hybrid-swa: tiny with 4 layers, 2 of them over a sliding window of 8.")]
Device = Annotated[DeviceName, typer.Option("--device", help="Where the engine and the canary run.")]
RealKv = Annotated[RealKV, typer.Option("--real-kv", help="Fingerprint of the real K/V bytes: none, the first "
                                        "16 bytes of each row, or all of it.")]
SweepInterval = Annotated[int, typer.Option("--sweep-interval", min=0, help="Steps between sweeps of idle "
                                            "prefix-cache slots (0 = never).")]
SweepBudget = Annotated[int, typer.Option("--sweep-budget", min=1, help="Bytes one sweep may read.")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="torch intra-op threads (default: 1 for "
                                             "tiny and hybrid-swa, whose small matmuls lose to thread barriers; 2 for "
                                             "small).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every violation and fault line.")]


def set_threads(threads: int | None, model: ModelSize) -> None:
    is_tiny = model in (ModelSize.tiny, ModelSize.hybrid_swa)
    torch.set_num_threads(threads or (1 if is_tiny else min(2, torch.get_num_threads())))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the progress display redirects it), one
    unwrapped line per record, so violation lines stay parseable with ``VIOLATION_RE``."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``; for
    the frozen violation, stats and watchdog lines also ``event`` and ``fields``, parsed with the
    line's regex (integers as numbers)."""

    EVENTS = (("violation", VIOLATION_RE), ("incidents", INCIDENTS_RE), ("stats", STATS_RE), ("watchdog", WATCHDOG_RE))

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
               "level": record.levelname, "logger": record.name, "message": message}
        for event, regex in self.EVENTS:
            match = regex.match(message)
            if match:
                out["event"] = event
                out["fields"] = {k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in match.groupdict().items()}
                break
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


_log_options = {"json_lines": False}


@app.callback()
def _global_options(
    log_json: Annotated[bool, typer.Option("--log-json", help="Log lines as JSON objects, one per line (the "
                                           "violation, stats and watchdog lines parsed into fields).")] = False,
) -> None:
    _log_options["json_lines"] = log_json


def setup_logging(level: int, json_lines: bool | None = None) -> None:
    """Violation, fault and stats lines of the ``kvcanary`` loggers go to stderr at ``level``, as
    plain lines or, with ``json_lines`` (default: the ``--log-json`` option), as JSON lines."""
    json_lines = _log_options["json_lines"] if json_lines is None else json_lines
    logger = logging.getLogger("kvcanary")
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(JsonLinesFormatter() if json_lines else logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def make_setup(requests: int, max_new_tokens: int, seed: int, model: ModelSize, device: DeviceName,
           canary: CanaryConfig, prompts: Path | None = None) -> RunSetup:
    if device is DeviceName.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine; use --device cpu", param_hint="--device")
    model_config = dataclasses.replace(MODELS[model.value], seed=seed)
    vocab = model_config.vocab_size
    try:
        if prompts is not None:
            workload = load_prompts(prompts, vocab)
        else:
            workload = builtin_workload(WorkloadConfig(num_requests=requests, max_new_tokens=max_new_tokens,
                                                       seed=seed, vocab_size=vocab))
    except (ConfigError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--prompts" if prompts else "--requests") from None
    return RunSetup(model_config, engine_config_for(workload, device.value), canary, workload)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


def tracker(progress: Progress, label: str, total: int):
    task = progress.add_task(label, total=total)
    return lambda done, n: progress.update(task, completed=done, total=n)


