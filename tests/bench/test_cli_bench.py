"""``kv-canary bench`` at tiny shapes on the CPU."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvcanary.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_bench_ops_quick_writes_json(tmp_path):
    path = tmp_path / "ops.json"
    result = invoke("bench", "ops", "--quick", "--device", "cpu", "--json", str(path))
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert {"meta", "correctness", "timing", "bandwidth_GBps", "errors", "passed"} <= data.keys()
    assert data["passed"] and data["meta"]["device"] == "cpu" and data["meta"]["torch"] == torch.__version__
    assert data["correctness"] and all(c["ok"] for c in data["correctness"])  # Triton (interpreted) == torch
    ops = {r["op"] for r in data["timing"]}
    assert {"scatter", "build_plan", "stamp", "verify", "fingerprint"} <= ops
    assert all(r["main_path"] == "torch" and r["floor_us"] > 0 for r in data["timing"])
    assert all(r.get("ring_rows_while_timing", 0) == 0 for r in data["timing"])  # timed inputs are clean
    assert "correctness" in result.output and "floor µs" in result.output


def test_bench_all_quick_one_file(tmp_path):
    path, md = tmp_path / "all.json", tmp_path / "overhead.md"
    result = invoke("bench", "all", "--quick", "--device", "cpu", "--modes", "identity", "--json", str(path),
                    "--markdown", str(md))
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data.keys() == {"ops", "overhead"}
    rows = data["overhead"]["rows"]
    assert rows and {r["mode"] for r in rows} == {"identity"} and data["overhead"]["passed"]
    assert data["overhead"]["meta"]["device_name"].startswith("cpu")
    assert md.read_text().startswith("| shape | mode |") and "identity only" in md.read_text()
    assert result.output.rstrip().splitlines()[-1].startswith("results written to")
    assert "study passed" in result.output


def test_bench_rejects_unknown_modes_and_missing_cuda():
    result = invoke("bench", "overhead", "--quick", "--modes", "identity,turbo")
    assert result.exit_code == 2 and "--modes" in result.output and "turbo" in result.output
    if not torch.cuda.is_available():
        result = invoke("bench", "ops", "--device", "cuda")
        assert result.exit_code == 2 and "CUDA is not available" in result.output


def test_bench_ops_without_triton_times_clean_inputs(tmp_path, monkeypatch):
    """Where Triton cannot run there are no cross-checks, and the torch path is timed on inputs the
    (unchecked) first run left untouched: no violation rows while timing."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = tmp_path / "ops.json"
    result = invoke("bench", "ops", "--quick", "--device", "cpu", "--json", str(path))
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["correctness"] == [] and data["meta"]["triton_cross_checks"] is False
    stamps = [r for r in data["timing"] if r["op"] == "stamp"]
    assert stamps and all(r["ring_rows_while_timing"] == 0 for r in stamps)
    assert "no cross-checks" in result.output
