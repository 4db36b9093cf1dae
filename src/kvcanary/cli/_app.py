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


# typer words a bad value's error with its validation library's phrases; the command line says them plainly
_PLAIN_WORDS = (
    (re.compile(r"^Value error, (.*?)\.?$"), r"\1"),
    (re.compile(r"^Input should be a valid integer.*"), "expected a whole number"),
    (re.compile(r"^Input should be a valid number.*"), "expected a number"),
    (re.compile(r"^Input should be greater than or equal to (\S+)$"), r"expected at least \1"),
    (re.compile(r"^Input should be less than or equal to (\S+)$"), r"expected at most \1"),
    (re.compile(r"^Input should be (.*)$"), r"expected \1"),
)


def plain_words(message: str, given: str | None = None) -> str:
    """``message`` without the validation library's phrases, naming ``given`` where it does not."""
    for pattern, words in _PLAIN_WORDS:
        if pattern.match(message):
            plain = pattern.sub(words, message)
            return plain if given is None or given in plain else f"{plain}, got {given!r}"
    return message


def _given(args: list[str], param) -> str | None:
    """The value ``args`` gave the option ``param`` (None for an argument, or when absent)."""
    for i, arg in enumerate(args):
        for name in getattr(param, "opts", ()):
            if name.startswith("-") and arg == name and i + 1 < len(args):
                return args[i + 1]
            if name.startswith("-") and arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


class _Commands(TyperGroup):
    """The command group: global flags given after the command (``kv-canary run --log-json``)
    are moved in front of it, where the group parses them; a bad value's error is worded plainly."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        hoisted = [a for a in args[:end] if a in GLOBAL_FLAGS]
        rest = [a for a in args[:end] if a not in GLOBAL_FLAGS]
        return super().parse_args(ctx, hoisted + rest + args[end:])

    def invoke(self, ctx):
        args = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:
            e.message = plain_words(e.message, _given(args, e.param))
            raise


app = typer.Typer(cls=_Commands, help="Make KV-cache corruption in LLM inference engines loud.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  options_metavar="[<options>]", subcommand_metavar="<command> [<args>]...",
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


