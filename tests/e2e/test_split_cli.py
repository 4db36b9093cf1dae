"""``kv-canary run --model hybrid-swa``, ``kv-canary run --pd`` and their part of ``kv-canary demo``."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvcanary.cli import app
from kvcanary.faults import PD_FAULTS, WINDOW_FAULTS

SMALL = ["--requests", "16", "--max-new-tokens", "6"]
SUMMARY_KEYS = {"requests", "finished", "aborted", "generated_tokens", "steps", "protected_slots", "verified_slots",
                "sweeps", "engine", "canary_time_share", "canary_seconds", "step_seconds", "violations", "by_reason",
                "by_launch_point", "watchdog_alarms", "stopped"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_run_hybrid_swa_reports_the_window_pool(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--model", "hybrid-swa", "--report", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    win = report["window_pool"]
    assert report["violations"] == 0 and win["violations"] == 0 and win["verified_slots"] > 0
    assert win["translated_positions"] > 0 and win["slid_out_positions"] > 0 and win["window"] == 8
    assert win["window_slots"] < report["config"]["engine"]["num_slots"]
    assert "window pool (W=8" in result.output and "slid out" in result.output


def test_run_hybrid_swa_with_the_window_fault_exits_1(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--model", "hybrid-swa", "--fault", "sliding_window_lut", "--fault-warmup", "12",
                    "--report", str(path))
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    assert report["window_pool"]["violations"] > 0 and report["by_reason"]["chain"] > 0
    assert report["by_launch_point"]["HEAD"] > 0 and report["first_violations"][0]["pool"] == "SWA"


def test_run_pd_reports_both_sides(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--pd", "--report", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert SUMMARY_KEYS <= report.keys() and report["violations"] == 0
    assert report["transfer"]["requests"] > 0 and report["transfer"]["bytes"] > 0
    for side in ("prefill", "decode"):
        assert report[side]["violations"] == 0 and report[side]["verified_slots"] > 0
    assert report["decode"]["engine"]["num_prefix_hit_tokens"] > 0
    assert "transferred requests / slots" in result.output and "violations prefill / decode" in result.output


def test_run_pd_with_a_transfer_fault_exits_1(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--pd", "--fault", "transfer_byte_flip", "--fault-warmup", "4",
                    "--report", str(path))
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    assert report["prefill"]["violations"] == 0 and report["decode"]["by_reason"].get("fingerprint", 0) > 0
    assert report["decode"]["by_launch_point"]["SWEEP"] > 0 and report["injections"][0]["fault"] == "transfer_byte_flip"


def test_run_pd_refuses_a_window_model():
    result = invoke("run", *SMALL, "--pd", "--model", "hybrid-swa")
    assert result.exit_code == 2 and "full-attention pools only" in result.output


def test_demo_runs_the_window_and_transfer_faults(tmp_path):
    path = tmp_path / "demo.json"
    result = invoke("demo", "--requests", "24", "--faults", "", "--bugs", "", "--json", str(path))
    assert result.exit_code == 0, result.output
    out = json.loads(path.read_text())
    assert out["passed"] and out["window"]["clean_violations"] == 0 and out["pd"]["clean_violations"] == 0
    assert [f["fault"] for f in out["window"]["faults"]] == list(WINDOW_FAULTS)
    assert [f["fault"] for f in out["pd"]["faults"]] == list(PD_FAULTS)
    for f in out["window"]["faults"] + out["pd"]["faults"]:
        assert f["detected"] is True and f["false_positives"] == 0 and f["steps_to_detection"] == 0
    assert "prefill/decode split" in result.output
