"""Incident report: a run's JSON report (``kv-canary run --report``) as one self-contained HTML page
and a PNG of its timeline.

The timeline (``report["timeline"]``, one entry per engine step) is drawn in two panels: violations
per step stacked by reason, with the steps faults were injected at marked; and the cache
traffic that usually explains them: sweeps, evicted, offloaded and loaded-back slots. The page
embeds the PNG (``<img id="timeline-plot">``) and tables of the figures, the injections, the
first incidents (a damaged slot and reason, with how often it was detected and how it closed:
``runtime.incidents``) and the first violations; it loads nothing from elsewhere.

Needs matplotlib (the ``server`` extra).
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

REASON_COLORS = {"chain": "#d62728", "position": "#ff7f0e", "fingerprint": "#9467bd", "write_token": "#8c564b",
                 "write_position": "#e377c2", "verify_token": "#bcbd22"}
TRAFFIC = {"sweeps": ("sweeps", "#1f77b4"), "evicted_slots": ("evicted slots", "#c7c7c7"),
           "offloaded_slots": ("offloaded slots", "#2ca02c"), "loaded_slots": ("loaded-back slots", "#17becf")}


@dataclass(frozen=True)
class IncidentPage:
    html: str
    png: bytes


def load_report(path: str | Path) -> dict:
    """The JSON report at ``path``. Raises ValueError naming the file when it is not a run report."""
    try:
        report = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}); pass the file written by "
                         "kv-canary run --report") from None
    if not isinstance(report, dict) or "violations" not in report:
        raise ValueError(f"{path} is not a run report (no 'violations' key); pass the file written by "
                         "kv-canary run --report")
    return report


def _check_timeline(timeline: dict) -> int:
    n = timeline.get("steps")
    if type(n) is not int or n < 0:
        raise ValueError(f"report timeline.steps must be an int >= 0, got {n!r}")
    series = [(k, timeline.get(k)) for k in TRAFFIC] + [(f"violations.{k}", v)
                                                        for k, v in timeline.get("violations", {}).items()]
    for name, values in series:
        if not isinstance(values, list) or len(values) != n:
            got = f"length {len(values)}" if isinstance(values, list) else repr(values)[:40]
            raise ValueError(f"report timeline.{name} must be a list of {n} counts (one per step), got {got}")
    return n


def plot_timeline(report: dict) -> bytes:
    """The timeline of ``report`` as PNG bytes (a note in the plot when the report has none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    timeline = report.get("timeline")
    if not timeline:
        top.text(0.5, 0.5, "this report has no per-step timeline", ha="center", va="center",
                 transform=top.transAxes)
        bottom.set_axis_off()
    else:
        n = _check_timeline(timeline)
        steps = list(range(n))
        base = [0] * n
        for reason, counts in timeline.get("violations", {}).items():
            top.bar(steps, counts, width=1.0, bottom=base, label=reason, color=REASON_COLORS.get(reason))
            base = [a + b for a, b in zip(base, counts, strict=True)]
        for i, inj in enumerate(report.get("injections", [])):
            top.axvline(inj["step"], color="black", linestyle="--", linewidth=1,
                        label="fault injected" if i == 0 else None)
        for key, (label, color) in TRAFFIC.items():
            if key == "sweeps":
                continue
            width = 3 if key == "evicted_slots" else 1  # offloaded slots are a subset: drawn on top
            bottom.step(steps, timeline[key], where="mid", label=label, color=color, linewidth=width)
        swept = [i for i, n in enumerate(timeline["sweeps"]) if n]
        bottom.plot(swept, [0] * len(swept), linestyle="none", marker="^", markersize=6,
                    color=TRAFFIC["sweeps"][1], label="sweep", clip_on=False)
        bottom.set_xlabel("engine step")
        bottom.set_ylabel("slots per step")
        bottom.legend(loc="upper right", fontsize=8, ncol=4)
        bottom.set_xlim(-0.5, max(n, 1) - 0.5)
        if top.get_legend_handles_labels()[0]:
            top.legend(loc="upper right", fontsize=8, ncol=4)
    top.set_ylabel("violations per step")
    top.set_title(f"kv-canary run: {report.get('violations', 0)} violations over {report.get('steps', 0)} steps")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _grid(columns: list[str], rows: list[list[object]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _summary(report: dict) -> list[tuple[str, object]]:
    eng = report.get("engine", {})
    rows = [("requests", report.get("requests")), ("generated tokens", report.get("generated_tokens")),
            ("steps", report.get("steps")), ("violations", report.get("violations")),
            ("incidents", report.get("incidents")), ("re-detections", report.get("redetections")),
            ("incidents by reason", ", ".join(f"{k}={v}" for k, v in report.get("incidents_by_reason", {}).items())
             or "-"),
            ("by reason", ", ".join(f"{k}={v}" for k, v in report.get("by_reason", {}).items()) or "-"),
            ("by launch point", ", ".join(f"{k}={v}" for k, v in report.get("by_launch_point", {}).items() if v)
             or "-"),
            ("protected slots (stamped)", report.get("protected_slots")),
            ("verified slots", report.get("verified_slots")), ("sweeps", report.get("sweeps")),
            ("watchdog alarms", report.get("watchdog_alarms")), ("stopped", report.get("stopped") or "-")]
    if eng:
        rows.append(("evicted / offloaded / loaded-back slots", f"{eng.get('num_evicted_slots')} / "
                     f"{eng.get('num_offloaded_slots')} / {eng.get('num_loaded_slots')}"))
    config = report.get("config", {})
    rows += [(f"config {k}", v) for k, v in config.items() if not isinstance(v, dict)]
    return [(k, "-" if v is None else v) for k, v in rows]


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}th{background:#f3f3f3}
.bad{color:#b00}.ok{color:#070}img{max-width:100%}"""


def _sources(entry: dict) -> str:
    """The KV sources a fingerprint failure names, as ``layer.half`` (``31.V``); ``-`` when none."""
    return ",".join(f"{s.get('layer')}.{s.get('half')}" for s in entry.get("sources", [])) or "-"


def render_incident(report: dict, title: str = "kv-canary incident report") -> IncidentPage:
    """The HTML page and the PNG timeline of a run report. Raises ValueError for a malformed timeline."""
    png = plot_timeline(report)
    n = report.get("violations", 0)
    num_incidents = report.get("incidents")
    counted = f"{n} violation(s)" + (f" in {num_incidents} incident(s)" if num_incidents is not None else "")
    verdict = f'<p class="bad">{counted} reported</p>' if n else '<p class="ok">no violation reported</p>'
    incidents = _grid(["id", "pool", "slot", "reasons", "first seen (step, point)", "tag", "sources", "detections",
                       "last step", "closed", "requests"],
                      [[i.get("id"), i.get("pool"), i.get("slot"), "+".join(i.get("reasons", [])),
                        f"{i.get('first_step')} {i.get('launch_point')}", i.get("tag", "-"), _sources(i),
                        i.get("detections"), i.get("last_step"),
                        f"{i.get('closed_by')} at {i.get('closed_step')}" if i.get("closed_by") else "open",
                        ",".join(f"{r['request']}@{r['position']}"
                                 for r in i.get("first_violation", {}).get("requests", []))]
                       for i in report.get("first_incidents", [])], "incidents")
    injections = _grid(["fault", "step", "slot", "detail"],
                       [[i.get("fault"), i.get("step"), i.get("slot"), i.get("detail")]
                        for i in report.get("injections", [])], "injections")
    violations = _grid(["step", "tag", "reasons", "sources", "slot", "position", "token", "expected token",
                        "requests"],
                       [[v.get("step"), v.get("tag"), "+".join(v.get("reasons", [])), _sources(v), v.get("slot"),
                         v.get("position"), v.get("token"), v.get("expected_token"),
                         ",".join(f"{r['request']}@{r['position']}" for r in v.get("requests", []))]
                        for v in report.get("first_violations", [])], "violations")
    data = base64.b64encode(png).decode()
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
{verdict}
<h2>Timeline</h2>
<img id="timeline-plot" alt="violations per step by reason; sweeps, evictions, offloads and load-backs per step"
 src="data:image/png;base64,{data}">
<h2>Figures</h2>
{_table(_summary(report))}
<h2>Injected faults</h2>
{injections}
<h2>First incidents</h2>
{incidents}
<h2>First violations</h2>
{violations}
<script>
const plot = document.getElementById("timeline-plot");
const mark = () => {{ plot.dataset.decodedWidth = String(plot.naturalWidth); }};
if (plot.complete) mark(); else plot.addEventListener("load", mark);
</script>
</body></html>
"""
    return IncidentPage(page, png)


def write_incident(report: dict, html_path: str | Path, png_path: str | Path | None = None,
                   title: str = "kv-canary incident report") -> tuple[Path, Path]:
    """Render ``report`` and write the page to ``html_path`` and the PNG to ``png_path`` (default:
    next to the page, suffix ``.png``). Returns both paths."""
    html_path = Path(html_path)
    png_path = Path(png_path) if png_path is not None else html_path.with_suffix(".png")
    incident = render_incident(report, title)
    html_path.write_text(incident.html)
    png_path.write_bytes(incident.png)
    return html_path, png_path
