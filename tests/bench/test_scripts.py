"""Smoke runs of the scripts behind BENCHMARKS.md, at tiny sizes on the CPU: each runs to the end
and reports what its table reads (cross-checks passed, zero violations, the figures present).
``bench_engine.py`` and ``bench_agreement.py`` have files of their own (tests/bench,
tests/distributed); the last test holds every script in benchmarks/ to having one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
MAX_SCRIPTS = 15


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    out = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_bench_ops_cross_checks_every_op(tmp_path):
    path = tmp_path / "ops.json"
    run_script("bench_ops.py", "--quick", "--check-only", "--json", str(path))
    result = json.loads(path.read_text())
    assert result["passed"] is True and result["errors"] == []
    checked = result["correctness"]
    assert len(checked) >= 10 and all(c["ok"] and c["problems"] == [] for c in checked), checked
    names = " ".join(c["name"] for c in checked)
    for op in ("scatter", "gather", "stamp", "verify", "build_plan", "fingerprint"):
        assert op in names, op


def test_bench_overhead_measures_each_mode_and_catches_its_tripwires(tmp_path):
    path = tmp_path / "overhead.json"
    out = run_script("bench_overhead.py", "--quick", "--device", "cpu", "--modes", "identity,partial",
                     "--json", str(path))
    result = json.loads(path.read_text())
    assert result["passed"] is True and result["errors"] == []
    assert {row["mode"] for row in result["rows"]} == {"identity", "partial"}
    assert re.search(r"study passed: \d+ cells, 0 errors, 0 violations in timed steps, 0 tripwires missed",
                     out.stdout), out.stdout[-1500:]


def test_bench_cpu_share_times_the_canarys_methods():
    out = run_script("bench_cpu_share.py", "--requests", "8", "--max-new-tokens", "4")
    calls = {m["name"]: int(m["calls"]) for m in re.finditer(r"^(?P<name>\w+) +[\d.]+ +[\d.]+ +(?P<calls>\d+) ",
                                                               out.stderr, flags=re.M)}
    assert calls.get("tail", 0) > 0 and calls["tail"] == calls["launch_head"] == calls["end_step"], calls
    shares = re.findall(r"canary share of Engine.step, (wall|cpu) clock: ([\d.]+)%", out.stderr)
    assert [clock for clock, _ in shares] == ["wall", "cpu"] and all(0 < float(s) < 100 for _, s in shares)


def test_bench_transformers_compares_on_and_off(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "transformers.json"
    run_script("bench_transformers.py", "--device", "cpu", "--shape", "tiny", "--repeats", "1", "--requests", "4",
               "--max-new-tokens", "4", "--system-len", "16", "--json", str(path))
    result = json.loads(path.read_text())
    assert result["violations"] == 0 and result["outputs_identical"] is True
    assert 0 < result["ratio_on_off"] and 0 < result["canary_share"] < 1


def test_soak_random_runs_a_configuration_clean(tmp_path):
    path = tmp_path / "soak.json"
    run_script("soak_random.py", "--tokens", "300", "--deadline-s", "120", "--json", str(path))
    result = json.loads(path.read_text())
    assert result["configurations"] >= 1 and result["generated_tokens"] >= 300
    assert result["violations"] == 0 and result["watchdog_alarms"] == 0 and result["verified_slots"] > 0


def test_every_benchmark_script_has_a_smoke_test():
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.is_file())
    assert 0 < len(scripts) <= MAX_SCRIPTS, scripts
    tests = " ".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    untested = [s for s in scripts if f'"{s}"' not in tests]
    assert not untested, f"scripts without a smoke test: {untested}"
