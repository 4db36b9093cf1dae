"""``kv-canary report``: a run's JSON report as a self-contained HTML incident page and a PNG timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcanary.cli._app import app, console


@app.command(help="Render a run's JSON report (kv-canary run --report <run.json>) into a self-contained HTML page "
                  "with a timeline plot (violations per step by reason, sweeps, evictions, offloads, load-backs) "
                  "and a PNG of the same plot.")
def report(
    run_json: Annotated[Path, typer.Argument(help="The JSON report written by kv-canary run "
                                             "--report.", exists=True, dir_okay=False, readable=True)],
    html: Annotated[Path | None, typer.Option("--html", help="Where to write the page (default: <run>.html next "
                                              "to the JSON).")] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Where to write the PNG (default: the page's path "
                                             "with suffix .png).")] = None,
) -> None:
    """Write the page and the PNG; print their paths."""
    from kvcanary.incident import load_report, write_incident

    try:
        data = load_report(run_json)
        html_path, png_path = write_incident(data, html or run_json.with_suffix(".html"), png,
                                             title=f"kv-canary incident report: {run_json.name}")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="run_json") from None
    console.print(f"incident report written to {html_path} (plot: {png_path})", highlight=False)
