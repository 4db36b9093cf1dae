"""The command line, in process through typer's runner and once as ``python -m kvcanary``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcanary.cli import app
from kvcanary.faults import FAULTS

SMALL = ["--requests", "32", "--max-new-tokens", "8"]
REPORT_KEYS = {"requests", "generated_tokens", "violations", "by_reason", "by_launch_point", "canary_time_share",
               "engine", "canary", "protected_slots", "verified_slots", "sweeps", "watchdog_alarms", "stopped"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_run_clean_writes_the_report(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--report", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert REPORT_KEYS <= report.keys()
    assert report["violations"] == 0 and report["by_reason"] == {} and report["stopped"] is None
    assert report["requests"] == 32 and report["generated_tokens"] > 0 and 0 < report["canary_time_share"] < 1
    engine = report["engine"]
    assert engine["num_loaded_slots"] > 0 and engine["num_offloaded_slots"] > 0 and engine["num_aborts"] > 0
    assert report["canary"]["counters"]["HEAD"]["launches"] == engine["num_steps"]
    assert "violations" in result.output and "canary time share" in result.output


def test_run_with_a_fault_exits_1_and_counts_it(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--fault", "page_table_repoint", "--report", str(path))
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    assert report["violations"] > 0 and report["by_reason"]["chain"] > 0 and report["by_launch_point"]["HEAD"] > 0
    assert report["injections"][0]["fault"] == "page_table_repoint"
    assert report["first_violations"][0]["launch_point"] == "HEAD"


def test_run_raise_policy_stops_and_exits_1(tmp_path):
    path = tmp_path / "report.json"
    result = invoke("run", *SMALL, "--policy", "raise", "--fault", "stale_slot_reuse", "--report", str(path))
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    assert "KV-cache violation" in report["stopped"] and report["violations"] > 0


@pytest.mark.parametrize("options", [["--policy", "off"], ["--policy", "recompute", "--real-kv", "all"],
                                     ["--real-kv", "none", "--no-truth", "--sweep-interval", "0"],
                                     ["--sweep-budget", "4096", "--stats-period", "10", "--model", "small"]])
def test_run_options_clean(options):
    result = invoke("run", "--requests", "12", "--max-new-tokens", "4", *options)
    assert result.exit_code == 0, result.output


def test_run_reads_a_prompt_file(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": list(range(i, i + 20)), "max_new_tokens": 3})
                                 for i in range(5)))
    path = tmp_path / "report.json"
    assert invoke("run", "--prompts", str(prompts), "--report", str(path)).exit_code == 0
    report = json.loads(path.read_text())
    assert report["requests"] == 5 and report["generated_tokens"] == 15


@pytest.mark.parametrize("args, message", [
    (["--prompts", "missing.jsonl"], "missing.jsonl"),
    (["--fault", "nope"], "unknown fault"),
    (["--policy", "sometimes"], "sometimes"),
])
def test_run_rejects_bad_options(args, message):
    result = invoke("run", *args)
    assert result.exit_code == 2 and message in result.output


def test_demo_detects_every_fault(tmp_path):
    path = tmp_path / "demo.json"
    result = invoke("demo", "--requests", "32", "--json", str(path))
    assert result.exit_code == 0, result.output
    out = json.loads(path.read_text())
    assert out["clean_violations"] == 0 and [f["fault"] for f in out["faults"]] == list(FAULTS)
    for f in out["faults"]:
        # found at the step of the injection, or at the next one for damage done after the step's TAIL
        assert f["detected"] is True and f["false_positives"] == 0 and f["steps_to_detection"] in (0, 1)
        assert {"reasons", "launch_points", "expected_reasons", "expected_launch_point"} <= f.keys()
        assert set(f["expected_reasons"]) <= set(f["reasons"]) and f["expected_launch_point"] in f["launch_points"]
    assert "all faults detected" in result.output


def test_demo_fails_when_the_canary_cannot_see_the_bytes(tmp_path):
    path = tmp_path / "demo.json"
    result = invoke("demo", "--requests", "32", "--real-kv", "none", "--faults", "used_slot_flip,cached_slot_flip",
                    "--json", str(path))
    assert result.exit_code == 1
    assert [f["detected"] for f in json.loads(path.read_text())["faults"]] == [False, False]


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "kvcanary", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "demo" in done.stdout and "run" in done.stdout
