"""``kv-canary soak`` and the zoo section of ``kv-canary demo``, in process through typer's runner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvcanary.cli import app
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.runs.soak import MECHANISMS, soak_workload


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_short_soak_exercises_every_mechanism_cleanly(tmp_path):
    path = tmp_path / "soak.json"
    result = invoke("soak", "--tokens", "2000", "--json", str(path))
    assert result.exit_code == 0, result.output
    out = json.loads(path.read_text())
    assert out["passed"] is True and out["violations"] == 0 and out["watchdog_alarms"] == 0
    assert out["generated_tokens"] >= 2000 and out["missing_mechanisms"] == []
    assert set(out["mechanisms"]) == set(MECHANISMS) and all(n > 0 for n in out["mechanisms"].values())
    assert out["config"]["real_kv"] == "all" and out["engine"]["num_loaded_slots"] == out["mechanisms"]["loaded_slots"]
    assert "soak passed" in result.output and "preemptions" in result.output


def test_soak_that_never_evicted_fails(tmp_path):
    path = tmp_path / "soak.json"
    result = invoke("soak", "--tokens", "40", "--json", str(path))
    assert result.exit_code == 1
    out = json.loads(path.read_text())
    assert out["passed"] is False and out["violations"] == 0 and "evicted_slots" in out["missing_mechanisms"]
    assert "never exercised" in result.output


def test_soak_workload_is_just_long_enough():
    for tokens in (1, 100, 1234):
        w = soak_workload(tokens, WorkloadConfig())
        generated = [r.abort_after or r.max_new_tokens for r in w.requests]
        assert sum(generated) >= tokens > sum(generated[:-1])


def test_demo_zoo_section_reports_like_the_faults(tmp_path):
    path = tmp_path / "demo.json"
    bugs = "stale_radix_node,reprefill_prompt_only"
    result = invoke("demo", "--requests", "8", "--warmup", "4", "--faults", "page_table_repoint", "--bugs", bugs,
                    "--json", str(path))
    assert result.exit_code == 0, result.output
    out = json.loads(path.read_text())
    assert out["passed"] is True and out["zoo_passed"] is True
    assert [z["fault"] for z in out["zoo"]] == bugs.split(",")
    assert all(z.keys() == f.keys() for z in out["zoo"] for f in out["faults"])
    for z in out["zoo"]:
        assert z["detected"] is True and z["false_positives"] == 0 and z["steps_to_detection"] >= 0
    assert "real-bug zoo" in result.output and "sglang#" in result.output


def test_demo_fails_when_a_zoo_bug_is_missed(tmp_path):
    path = tmp_path / "demo.json"
    result = invoke("demo", "--requests", "8", "--faults", "", "--bugs", "abort_inflight_write", "--real-kv", "none",
                    "--json", str(path))
    assert result.exit_code == 1  # its damage is K/V bytes only: invisible without fingerprints
    zoo = json.loads(path.read_text())["zoo"]
    assert [(z["fault"], z["injected"], z["detected"]) for z in zoo] == [("abort_inflight_write", True, False)]


def test_demo_rejects_an_unknown_bug():
    result = invoke("demo", "--bugs", "no_such_bug")
    assert result.exit_code == 2 and "unknown bug" in result.output
