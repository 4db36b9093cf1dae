"""The toy engine of examples/ runs through the public API alone: clean, it reports nothing; each
seeded fault is detected with its reason at its launch point."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

TOY = Path(__file__).resolve().parents[1] / "examples" / "toy_engine.py"
LINE = re.compile(r"^(?P<fault>\w+): (?P<verdict>detected|MISSED) expected=(?P<expected>\w+@\w+) "
                  r"first=(?P<reasons>[\w+]+) at (?P<point>[A-Z]+) step=(?P<step>\d+) slot=(?P<slot>\d+) "
                  r"violations=(?P<violations>\d+)$")


def test_toy_engine_detects_each_seeded_fault_and_the_clean_run_is_silent():
    out = subprocess.run([sys.executable, str(TOY)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "clean: 0 violations"
    found = {m["fault"]: m for m in map(LINE.match, lines[1:]) if m}
    assert set(found) == {"page_table_repoint", "kv_flip", "host_copy_flip"}, out.stdout
    expected = {"page_table_repoint": ("chain", "HEAD", 8), "kv_flip": ("fingerprint", "TAIL", 8),
                "host_copy_flip": ("fingerprint", "SWEEP", 13)}
    for fault, (reason, point, step) in expected.items():
        m = found[fault]
        assert m["verdict"] == "detected" and m["expected"] == f"{reason}@{point}"
        assert reason in m["reasons"].split("+") and m["point"] == point and int(m["step"]) == step, m[0]
    assert found["kv_flip"]["reasons"] == "fingerprint" and found["host_copy_flip"]["reasons"] == "fingerprint"
    # the damage is logged once per incident, in the frozen violation format
    assert "kv_canary violation: step=8 tag=TAIL.FULL.K reason=fingerprint" in out.stderr


def test_toy_engine_uses_the_public_api_only_and_stays_small():
    source = TOY.read_text()
    assert len(source.splitlines()) < 200
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert {m for m in imported if m.startswith("kvcanary")} <= {"kvcanary", "kvcanary.ops"}, imported
