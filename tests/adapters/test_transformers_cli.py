"""``kv-canary run --engine transformers``: the built-in workload through transformers, canary on."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvcanary.cli import app

SMALL = ["--requests", "12", "--max-new-tokens", "6"]
REPORT_KEYS = {"requests", "finished", "generated_tokens", "steps", "violations", "by_reason", "by_launch_point",
               "canary_time_share", "engine", "canary", "protected_slots", "verified_slots", "sweeps",
               "watchdog_alarms", "stopped", "step_seconds"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_run_engine_transformers_is_clean_and_reports(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", "--engine", "transformers", *SMALL, "--sweep-interval", "2", "--report", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert REPORT_KEYS <= report.keys() and report["engine_name"] == "transformers"
    assert report["violations"] == 0 and report["stopped"] is None and report["finished"] == 12
    assert report["generated_tokens"] == 12 * 6 and report["protected_slots"] > 0 and report["sweeps"] > 0
    assert report["engine"]["adapter_prefix_hit_tokens"] > 0  # the workload's shared system prompts
    assert "kv-canary run" in result.output


def test_run_engine_transformers_refuses_faults_with_a_clear_error():
    result = invoke("run", "--engine", "transformers", *SMALL, "--fault", "page_table_repoint")
    assert result.exit_code == 2
    assert "--fault" in result.output and "tests/adapters" in result.output
