"""Incidents reach every surface: the run report's JSON keys, the incident HTML page and the admin
route ``GET /canary/incidents``; a clean run has none."""

from __future__ import annotations

import re
import threading

import pytest

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import UsedSlotFlip
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import report as run_report
from kvcanary.runs.single import run_once


def _setup() -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=10, max_new_tokens=12, seed=1))
    return RunSetup(ModelConfig(seed=1), engine_config_for(workload, num_slots=192, host_tier_slots=192),
                    CanaryConfig(sweep_interval=2), workload)


@pytest.fixture(scope="module")
def faulty():
    setup = _setup()
    out = run_once(setup, [UsedSlotFlip(seed=0, warmup_steps=6)])
    return out, run_report(setup, out).to_json()


def test_the_run_report_counts_incidents_beside_violations(faulty):
    out, report = faulty
    (inj,) = out.injections
    assert report["violations"] > report["incidents"] >= 1 and report["redetections"] >= 1
    assert report["violations"] == report["incidents"] + report["redetections"]  # each opens one or re-detects
    first = report["first_incidents"][0]
    assert first["slot"] == inj.slot and first["reasons"] == ["fingerprint"] and first["detections"] >= 2
    assert report["incidents_by_reason"] == {"fingerprint": report["incidents"]}
    assert sum(x["incidents"] for x in report["incidents_by_label"]) == report["incidents"]
    assert first["first_violation"] == next(v for v in report["first_violations"] if v["slot"] == inj.slot)


def test_a_clean_run_reports_no_incident():
    setup = _setup()
    report = run_report(setup, run_once(setup)).to_json()
    assert report["violations"] == report["incidents"] == report["redetections"] == 0
    assert report["first_incidents"] == [] and report["incidents_by_reason"] == {}


def test_the_incident_page_lists_the_incidents(faulty):
    pytest.importorskip("matplotlib")
    from kvcanary.incident import render_incident

    _, report = faulty
    page = render_incident(report).html
    table = page[page.index('<table id="incidents">'):]
    table = table[: table.index("</table>")]
    assert table.count("<tr>") == 1 + len(report["first_incidents"])
    assert f"in {report['incidents']} incident(s)" in page and "fingerprint" in table


def test_the_admin_route_answers_the_incidents(faulty):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvcanary.server.admin import AdminTarget, CanaryAdmin, admin_app

    out, report = faulty
    admin = CanaryAdmin(AdminTarget(out.hooks.canary, threading.RLock()))
    with TestClient(admin_app(admin)) as client:
        body = client.get("/canary/incidents").json()
        assert client.get("/canary/incidents?limit=0").status_code in (400, 422)
    assert body["incidents"] == report["incidents"] and body["redetections"] == report["redetections"]
    assert body["first_incidents"] == report["first_incidents"]
    assert [i["id"] for i in body["open_incidents"]] == [i["id"] for i in report["first_incidents"] if i["open"]]


def _flipped(inj) -> tuple[int, str]:
    layer, half = re.search(r"layer=(\d+) half=([KV])", inj.detail).groups()
    return int(layer), half


def test_incidents_and_violations_name_the_flipped_layer_and_half(faulty):
    out, report = faulty
    (inj,) = out.injections
    layer, half = _flipped(inj)
    first = report["first_incidents"][0]
    assert (first["tag"], first["layer"], first["sources"]) == (f"TAIL.FULL.{half}", layer,
                                                                [{"layer": layer, "half": half}])
    hit = [v for v in report["first_violations"] if v["slot"] == inj.slot]
    assert hit and all((v["tag"], v["layer"], v["sources"]) == (first["tag"], layer, first["sources"]) for v in hit)


def test_the_incident_page_shows_the_sources(faulty):
    pytest.importorskip("matplotlib")
    from kvcanary.incident import render_incident

    out, report = faulty
    layer, half = _flipped(out.injections[0])
    page = render_incident(report).html
    for table_id in ("incidents", "violations"):
        table = page[page.index(f'<table id="{table_id}">'):]
        table = table[: table.index("</table>")]
        assert "<th>sources</th>" in table and f"<td>{layer}.{half}</td>" in table, table_id


def test_the_admin_violations_route_carries_layer_and_sources(faulty):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvcanary.server.admin import AdminTarget, CanaryAdmin, admin_app

    out, _ = faulty
    layer, half = _flipped(out.injections[0])
    admin = CanaryAdmin(AdminTarget(out.hooks.canary, threading.RLock()))
    admin.log.add(out.violations)
    with TestClient(admin_app(admin)) as client:
        body = client.get("/canary/violations?since=0").json()
    rows = [v for v in body["violations"] if "fingerprint" in v["reasons"]]
    assert rows and all((v["layer"], v["sources"]) == (layer, [{"layer": layer, "half": half}]) for v in rows)
