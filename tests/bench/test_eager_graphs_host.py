"""``benchmarks/eager_graphs_host.py`` runs its whole path on the CPU (the interpreted kernel): both
canaries step without violations, the graphs canary takes every step through its bucket, and the
table and JSON name every shape. (Its timings are a GPU's to give.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eager_graphs_host.py"


def test_the_script_steps_both_canaries_and_reports_every_shape(tmp_path):
    out = tmp_path / "eager.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--iters", "4", "--shapes", "1x0x8,2x16x4",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["1x0x8", "2x16x4"]
    # the fill of a shape with a prefix is an eager forward too: its own bucket, one replay
    assert [(r["graphs replays"], r["graphs buckets"]) for r in rows] == [(4, 1), (5, 2)]
    for r in rows:
        assert all(r[f"{m} {p} µs"] > 0 for m in ("launches", "graphs") for p in ("head", "tail"))
    assert "| 2x16x4 |" in proc.stdout
