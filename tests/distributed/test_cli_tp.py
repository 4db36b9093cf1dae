"""``kv-canary run --tp 2`` end to end (its own two processes: slow, outside CI; the same paths run
in CI through ``test_tp.py``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvcanary.cli import app

pytestmark = pytest.mark.slow


def test_run_tp_2_reports_per_rank_and_exits_1_on_a_fault(tmp_path):
    path = tmp_path / "report.json"
    args = ["run", "--tp", "2", "--requests", "16", "--max-new-tokens", "8", "--report", str(path)]
    result = CliRunner().invoke(app, [*args, "--fault", "page_table_repoint", "--fault-warmup", "8"])
    assert result.exit_code == 1, result.output
    report = json.loads(path.read_text())
    assert report["config"]["tp"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    rank0, rank1 = report["ranks"]
    assert rank1["injections"] and not rank0["injections"]  # faults act on the last rank
    assert rank0["rank_divergences"][0]["ranks"] == [1] and rank0["violations_decoded"] == 0
    assert report["violations"] == rank0["violations"] + rank1["violations"] > 0
    assert report["by_reason"]["rank_divergence"] == 2 * len(rank0["rank_divergences"])
    assert "per rank" in result.output and "rank divergences" in result.output
    clean = CliRunner().invoke(app, args)
    assert clean.exit_code == 0, clean.output
    assert json.loads(path.read_text())["violations"] == 0


def test_run_tp_rejects_heads_that_do_not_split():
    result = CliRunner().invoke(app, ["run", "--tp", "3", "--requests", "4"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # the error box wraps lines
    assert "must be a multiple of the tensor-parallel ranks (3)" in text
