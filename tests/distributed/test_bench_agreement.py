"""``benchmarks/bench_agreement.py`` runs on the CPU with gloo (two ranks, tiny sizes): one row per
batch size and policy, the policy's lag, a clean agreement (no divergence), positive timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_agreement.py"


def test_bench_agreement_runs_on_cpu_with_gloo(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--nproc", "2", "--batch-sizes", "1,8", "--hidden", "32",
           "--layers", "1", "--num-slots", "1024", "--steps", "3", "--blocks", "1", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["environment"]["backend"] == "gloo" and result["environment"]["world"] == 2
    rows = result["rows"]
    assert [(r["bs"], r["policy"], r["lag"]) for r in rows] == [(1, "log", 1), (1, "recompute", 0), (8, "log", 1),
                                                                   (8, "recompute", 0)]
    for r in rows:
        assert r["divergences"] == 0 and not r["graph"] and r["graph_error"] is None
        assert r["base_us"] > 0 and r["agreed_us"] > 0 and r["agreement_host_us"] > 0
        assert len(r["base_blocks_us"]) == len(r["agreed_blocks_us"]) == 1
    assert "with agreement" in proc.stdout and proc.stdout.count(" log ") == 2
