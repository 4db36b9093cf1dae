"""``benchmarks/forward_batch_build.py`` builds every shape it names with token truth on and off
and reports each, and refuses a malformed shape naming it. (Its timings are for a quiet host.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "forward_batch_build.py"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}


def test_the_script_times_every_shape_on_and_off(tmp_path):
    out = tmp_path / "build.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "decode:3x20,prefill:2x15", "--repeats", "1",
                           "--number", "3", "--json", str(out)], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["decode:3x20", "prefill:2x15"]
    for r in rows:
        assert r["off µs"] > 0 and r["on µs"] > 0 and r["truth µs"] == r["on µs"] - r["off µs"]
    assert "| prefill:2x15 |" in proc.stdout


def test_a_malformed_shape_is_refused_by_name():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "decode:3"], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode != 0 and "shape 'decode:3'" in proc.stderr
