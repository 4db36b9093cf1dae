"""Shared pieces of the command line: the Typer app, consoles, logging, errors, progress bars."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import logging
import re
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

from kvcanary import __version__

GLOBAL_FLAGS = ("--log-json", "--version")  # accepted before the command and after it


class _Commands(TyperGroup):
    """The command group: global flags given after the command (``kv-canary run --log-json``)
    are moved in front of it, where the group parses them."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        hoisted = [a for a in args[:end] if a in GLOBAL_FLAGS]
        rest = [a for a in args[:end] if a not in GLOBAL_FLAGS]
        return super().parse_args(ctx, hoisted + rest + args[end:])


app = typer.Typer(cls=_Commands, help="Make KV-cache corruption in LLM inference engines loud.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
console = Console()
if not console.is_terminal:
    console.width = 132  # reports piped to a file or a CI log: no need to wrap at 80 columns
err_console = Console(stderr=True)

# --- shared options ------------------------------------------------------------------------------



@contextlib.contextmanager
def options_checked():
    """Turn what a run refuses into the command line's errors: a bad option -> usage error (exit
    2) naming the option; a missing extra -> one line naming it (exit 2)."""
    from kvcanary.errors import ConfigError
    from kvcanary.runs.setup import MissingExtra, OptionError

    try:
        yield
    except MissingExtra as e:
        print(e, file=sys.stderr)  # one unwrapped line
        raise typer.Exit(2) from None
    except OptionError as e:
        raise typer.BadParameter(str(e), param_hint=e.option) from None
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None


def require_extra(module: str, extra: str, what: str) -> None:
    """One line naming the extra and exit 2 when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        from kvcanary.runs.setup import MissingExtra

        print(MissingExtra(extra, what), file=sys.stderr)  # one unwrapped line
        raise typer.Exit(2)


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

    def __init__(self) -> None:
        super().__init__()
        from kvcanary.runtime.reporting import INCIDENTS_RE, STATS_RE, VIOLATION_RE, WATCHDOG_RE

        self.events = (("violation", VIOLATION_RE), ("incidents", INCIDENTS_RE), ("stats", STATS_RE),
                       ("watchdog", WATCHDOG_RE))

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
               "level": record.levelname, "logger": record.name, "message": message}
        for event, regex in self.events:
            match = regex.match(message)
            if match:
                out["event"] = event
                out["fields"] = {k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in match.groupdict().items()}
                break
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


_log_options = {"json_lines": False}


def _print_version(value: bool) -> None:
    if value:
        console.print(f"kv-canary {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _global_options(
    log_json: Annotated[bool, typer.Option("--log-json", help="Log lines as JSON objects, one per line (the "
                                           "violation, stats and watchdog lines parsed into fields).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
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


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


def tracker(progress: Progress, label: str, total: int):
    task = progress.add_task(label, total=total)
    return lambda done, n: progress.update(task, completed=done, total=n)


