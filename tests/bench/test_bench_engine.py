"""``benchmarks/bench_engine.py --lockstep`` on the CPU: stepping the engines in turn computes
what each engine computes alone, and its per-kind figures add up to the run's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("turn", [1, 3])
def test_lockstep_runs_what_each_engine_runs_alone(bench, turn):
    prompts = bench.workload(512, 5, seed=7)
    alone = {}
    for m in ("off", "partial"):
        engine, _ = bench.build(m, "cpu", {})
        alone[m] = list(engine.generate(prompts, 4).values())
    engines = {m: bench.build(m, "cpu", {}) for m in ("partial", "off")}
    out = bench.run_lockstep(engines, prompts, 4, turn)
    assert set(out) == {"off", "partial"}
    for m, r in out.items():
        engine = engines[m][0]
        got = [engine.output_ids(i) for i in sorted(engine.requests)]
        assert got == alone[m]
        assert r["tokens"] == 5 * 4 and r["violations"] == 0
        assert r["steps"] == engine.stats.num_steps == r["eager"] and r["replayed"] == 0  # the CPU: no graphs
        assert 0 < r["eager_s"] <= r["seconds"] and r["replayed_s"] == 0 == r["graph_device_s"]
        assert r["tok_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        canary = r["eager_canary_s"] + r["replayed_canary_s"]
        if m == "off":
            assert canary == 0 == r["canary_seconds"]
        else:
            assert 0 < canary <= r["canary_seconds"] and r["canary_seconds"] < r["seconds"]
    assert out["off"]["steps"] == out["partial"]["steps"]


@pytest.mark.parametrize("args, message", [
    (["--lockstep", "-1"], "--lockstep takes a number of steps >= 1, got -1"),
    (["--lockstep", "2", "--fresh-engines"], "it does not take --fresh-engines"),
])
def test_lockstep_arguments_checked(args, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr
