"""One benchmark run's record: metadata, sections (timed, errors kept), JSON written as it goes."""

from __future__ import annotations

import json
import time
import traceback
from contextlib import contextmanager
from pathlib import Path


class RunRecord:
    """Collects a run's results in ``data`` and writes them to ``json_path`` after every section,
    so a run killed by a time limit still leaves what it measured. A section that raises is
    recorded in ``data["errors"]`` and the run goes on (one failing op must not lose the rest)."""

    def __init__(self, json_path: str | Path | None, meta: dict, budget_s: float = float("inf")):
        self.json_path = Path(json_path) if json_path else None
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict = {"meta": meta, "errors": [], "sections": {}}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def over_budget(self) -> bool:
        return self.elapsed > self.budget_s

    @property
    def errors(self) -> list[dict]:
        return self.data["errors"]

    @contextmanager
    def section(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded with its traceback; the run goes on
            self.errors.append({"section": name, "error": repr(e), "traceback": traceback.format_exc()})
            print(f"ERROR     {name}: {e!r}", flush=True)
        self.data["sections"][name] = round(time.perf_counter() - t0, 2)
        self.save()

    def save(self) -> None:
        self.data["meta"]["elapsed_s"] = round(self.elapsed, 1)
        if self.json_path is None:
            return
        try:
            self.json_path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        except OSError as e:
            print(f"cannot write {self.json_path}: {e!r}", flush=True)
            self.json_path = None


def fmt(value, spec: str, width: int = 0) -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is None, right-aligned to ``width``."""
    return ("-" if value is None else format(value, spec)).rjust(width)
