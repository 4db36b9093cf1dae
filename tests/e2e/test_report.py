"""Incident report: the run's per-step timeline, the HTML page opened in headless Chromium (the
plot element exists and its PNG decodes), ``kv-canary report``, ``run --report`` writing the page,
and the ``--log-json`` lines."""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
import subprocess

import pytest
from typer.testing import CliRunner

from kvcanary.cli import app
from kvcanary.cli._app import JsonLinesFormatter
from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import UsedSlotFlip
from kvcanary.incident import load_report, render_incident, write_incident
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import report, run_once
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.runtime.reporting import STATS_RE, WATCHDOG_RE
from kvcanary.runtime.watchdog import WatchdogAlarm

pytest.importorskip("matplotlib")


def _setup() -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=10, max_new_tokens=6, seed=1))
    return RunSetup(ModelConfig(seed=1), engine_config_for(workload, num_slots=192, host_tier_slots=192),
                    CanaryConfig(sweep_interval=2), workload)


@pytest.fixture(scope="module")
def faulty_report() -> dict:
    setup = _setup()
    return report(setup, run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=6)])).to_json()


@pytest.fixture(scope="module")
def clean_report() -> dict:
    setup = _setup()
    return report(setup, run_once(setup)).to_json()


def test_timeline_adds_up_to_the_run_totals(faulty_report):
    r, t = faulty_report, faulty_report["timeline"]
    assert t["steps"] == r["steps"] == r["engine"]["num_steps"]
    assert {k: sum(v) for k, v in t["violations"].items()} == r["by_reason"] == {"fingerprint": r["violations"]}
    assert sum(t["sweeps"]) == r["sweeps"] > 0
    assert sum(t["evicted_slots"]) == r["engine"]["num_evicted_slots"] > 0
    assert sum(t["offloaded_slots"]) == r["engine"]["num_offloaded_slots"] > 0
    assert sum(t["loaded_slots"]) == r["engine"]["num_loaded_slots"]
    step = r["injections"][0]["step"]
    first = min(i for i, n in enumerate(t["violations"]["fingerprint"]) if n)
    assert first == r["first_violations"][0]["step"] == step + 1  # read by the next step's TAIL


def test_clean_timeline_has_no_violations(clean_report):
    t = clean_report["timeline"]
    assert t["violations"] == {} and t["steps"] == clean_report["steps"] and sum(t["sweeps"]) > 0


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


def test_html_page_opens_in_headless_chromium(faulty_report, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    page, png = write_incident(faulty_report, tmp_path / "incident.html")
    assert png == tmp_path / "incident.png" and _png_size(png.read_bytes()) == (1200, 550)
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert 'id="timeline-plot"' in dom, dom[:500]
    assert 'data-decoded-width="1200"' in dom  # the browser decoded the embedded PNG
    assert "http://" not in page.read_text() and "https://" not in page.read_text()  # self-contained
    assert 'id="injections"' in dom and "used_slot_flip" in dom
    assert dom.count("<tr>") >= 1 + 1 + len(faulty_report["first_violations"])


def test_page_without_a_timeline_still_renders():
    incident = render_incident({"violations": 0, "steps": 3})
    assert 'id="timeline-plot"' in incident.html and _png_size(incident.png) == (1200, 550)


def test_malformed_timeline_names_the_field(clean_report):
    bad = {**clean_report, "timeline": {**clean_report["timeline"], "sweeps": [1, 2]}}
    with pytest.raises(ValueError, match=r"timeline.sweeps must be a list of \d+ counts .* got length 2"):
        render_incident(bad)


def test_report_command_writes_page_and_png(faulty_report, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(faulty_report))
    result = CliRunner().invoke(app, ["report", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.html").read_text().startswith("<!DOCTYPE html>") and (tmp_path / "run.png").exists()
    assert load_report(path)["violations"] == faulty_report["violations"]


@pytest.mark.parametrize(("content", "fragment"), [("{not json", "is not JSON"), ('{"a": 1}', "not a run report")])
def test_report_command_rejects_other_files(tmp_path, content, fragment):
    path = tmp_path / "other.json"
    path.write_text(content)
    result = CliRunner().invoke(app, ["report", str(path)])
    assert result.exit_code == 2 and fragment in " ".join(result.output.replace("│", " ").split()), result.output


def test_run_report_writes_the_page_next_to_the_json(tmp_path):
    path = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", "--requests", "6", "--max-new-tokens", "4", "--report", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["timeline"]["steps"] > 0
    assert 'id="timeline-plot"' in (tmp_path / "r.html").read_text() and (tmp_path / "r.png").exists()
    assert "incident report written to" in result.output


def test_log_json_lines_parse_the_frozen_lines():
    fmt = JsonLinesFormatter()
    canary = Canary(CanaryConfig(), PoolGeometry(16, 2, 8))
    stats, alarm = canary.stats_line(4), WatchdogAlarm(LaunchPoint.SWEEP, 19, 18).line()
    assert STATS_RE.match(stats) and WATCHDOG_RE.match(alarm)
    out = [json.loads(fmt.format(logging.LogRecord("kvcanary", logging.INFO, __file__, 1, m, (), None)))
           for m in (stats, alarm, "fault used_slot_flip: step=3")]
    assert out[0]["event"] == "stats" and out[0]["fields"]["step"] == 4 and out[0]["fields"]["violations"] == 0
    assert out[1]["event"] == "watchdog" and out[1]["fields"] == {"point": "SWEEP", "silent_steps": 19, "window": 18}
    assert "event" not in out[2] and out[2]["message"] == "fault used_slot_flip: step=3"
    assert out[0]["level"] == "INFO" and out[0]["time"].endswith("+00:00")


def test_log_json_option_writes_violation_lines_as_json():
    result = CliRunner().invoke(app, ["--log-json", "run", "--requests", "8", "--max-new-tokens", "6",
                                      "--fault", "used_slot_flip", "--fault-warmup", "4"])
    assert result.exit_code == 1, result.output
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    events = [x for x in lines if x.get("event") == "violation"]
    flips = [re.search(r" half=([KV]) ", x["message"]) for x in lines
             if x["message"].startswith("fault used_slot_flip")]
    half = next(m[1] for m in flips if m)  # the tag names the half the fault flipped
    assert events and events[0]["fields"]["reason"] == "fingerprint"
    assert events[0]["fields"]["tag"] == f"TAIL.FULL.{half}"
    summary = [x for x in lines if x.get("event") == "incidents"]  # the re-detections, counted at the end
    assert summary and summary[-1]["fields"]["incidents"] == len(events) and summary[-1]["level"] == "WARNING"
    assert any(x["logger"] == "kvcanary.faults" for x in lines)
    plain = CliRunner().invoke(app, ["run", "--requests", "8", "--max-new-tokens", "6", "--fault", "used_slot_flip",
                                     "--fault-warmup", "4"])
    assert "kv_canary violation: step=" in plain.stderr and not plain.stderr.lstrip().startswith("{")


def test_the_docs_document_the_frozen_lines_and_their_regexes():
    from pathlib import Path

    from kvcanary.runtime.reporting import INCIDENTS_RE, VIOLATION_RE

    lines = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text().splitlines()
    for regex in (VIOLATION_RE, INCIDENTS_RE, STATS_RE, WATCHDOG_RE):
        assert regex.pattern in lines, f"docs/operating.md lacks the pattern of {regex.pattern[:40]}..."
    assert any(STATS_RE.match(line) for line in lines) and any(WATCHDOG_RE.match(line) for line in lines)
    assert any(INCIDENTS_RE.match(line) for line in lines)
