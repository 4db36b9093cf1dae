"""Smoke run of ``benchmarks/bench_vllm.py``: both engines start, the rounds run interleaved, outputs
match across modes, the canary reports nothing, and the table carries its figures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_vllm_runs_both_modes_interleaved(tmp_path):
    path = tmp_path / "vllm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--quick", "--model-dir",
                          str(tmp_path / "models"), "--json", str(path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    result = json.loads(path.read_text())
    assert result["errors"] == []
    assert set(result["modes"]) == {"off", "log-partial"}
    on = result["modes"]["log-partial"]
    assert len(on["ratio"]) == 2 and all(r > 0 for r in on["ratio"])  # a smoke run is too short to judge the ratio
    assert on["steps"] > 0 and on["host_us_per_step"] > 0
    assert result["modes"]["off"]["steps"] == 0  # no canary, no checked forwards
    assert re.search(r"^log-partial +[\d.]+ +[\d.]+ +[\d.]+-[\d.]+ +\d+$", out.stdout, re.M), out.stdout
