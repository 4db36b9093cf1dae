"""A small mutation pass over the detection code: plant one plausible bug at a time, run the tests
that should notice it, and report which bugs the suite lets through.

    python tools/mutation.py                 # the default sample (about 100 mutants), then the summary
    python tools/mutation.py --list          # the mutants only
    python tools/mutation.py --only 12 40    # these mutants (their numbers in --list)
    python tools/mutation.py --scale 0.3     # fewer mutants (a quick look)

Mutants (``ast``, one node each): a comparison flipped (``<`` <-> ``<=``, ``>`` <-> ``>=``,
``==`` <-> ``!=``), ``and`` <-> ``or``, a ``not`` dropped, an integer constant plus one, ``+`` <->
``-`` next to a constant, an increment dropped (``x += y`` -> ``x += 0``), a returned count
replaced by 0, a raise guard's condition replaced by ``False``. The sample is deterministic
(``--seed``): per file, its number of mutants (``TARGETS``) drawn from the functions it lists,
round robin over the kinds above.

Each mutant is written into a private copy of the repository (``src``, ``tests``, ``pyproject.toml``)
and the original restored, bytes and times, before the next; Python writes no bytecode there
(a stale ``.pyc`` of equal size and second would hide a mutant). The compiled CPU kernels
(numba, ``ops._cpu``) are cached on disk by their source file only, not by the modules whose
constants they fold in: a mutant in those files, or at module level anywhere, runs with an empty
numba cache (so the kernels really are rebuilt from the mutant) and must compile first, or it is
reported ``invalid``. The others share a cache warmed by the baseline. Each mutant runs its
file's tests (``-x``, one process, at most ``--slack`` times their baseline's seconds); killed = they
fail (a timeout counts as killed), survived = they pass.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS, RT = "src/kvcanary/ops/", "src/kvcanary/runtime/"
EDGES, CHECK, VERIFY = "tests/ops/test_edges.py", "tests/ops/test_check.py", "tests/ops/test_verify.py"
# file -> (mutants drawn, functions whose nodes may be mutated (empty: all), the tests that must
# kill them, fastest first)
ENGINE_TESTS = ("tests/runtime/test_edges.py", "tests/engine/test_raise_fails_requests.py",
                "tests/faults/test_abort_delivery.py")
TARGETS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    OPS + "_cpu_kernels.py": (12, (), (EDGES, "tests/runtime/test_cpu_forward.py", VERIFY, CHECK)),
    OPS + "check.py": (5, ("_check_torch", "check_forward"), (EDGES, CHECK)),
    OPS + "check_kernel.py": (5, (), (EDGES, CHECK)),
    OPS + "verify.py": (8, (), (VERIFY, EDGES)),
    OPS + "conflicts.py": (8, ("_writes_torch", "conflict_lanes", "mark_slots", "_mark_kernel", "_writes_kernel",
                               "counted_held", "epoch_key"), (EDGES, "tests/ops/test_conflicts.py")),
    OPS + "stamp.py": (6, (), ("tests/ops/test_stamp.py", EDGES)),
    OPS + "landed.py": (6, (), ("tests/ops/test_landed.py", EDGES)),
    OPS + "publish.py": (5, ("_publish_torch", "publish_row", "publish_counters"), ("tests/ops/test_publish.py",)),
    RT + "incidents.py": (8, ("_key", "note", "observe", "_apply_closes", "summary_line"),
                          ("tests/runtime/test_incidents.py", "tests/runtime/test_edges.py")),
    RT + "policy.py": (6, (), ("tests/runtime/test_policy_decision.py", "tests/runtime/test_policies.py")),
    RT + "step_end.py": (6, (), ("tests/runtime/test_edges.py", "tests/runtime/test_device_error.py",
                                 "tests/runtime/test_incidents.py",
                                 "tests/runtime/test_policies.py")),
    "src/kvcanary/engine/delivery.py": (7, (), ENGINE_TESTS),
    "src/kvcanary/engine/engine.py": (6, ("recompute", "fail", "apply_recovery"),
                                      ("tests/engine/test_engine.py::test_recompute_quarantines_and_reprefills",
                                       *ENGINE_TESTS)),
    "src/kvcanary/engine/canary_hooks.py": (4, ("after_forward", "_handle", "_fail", "flush"),
                                            (*ENGINE_TESTS, "tests/runtime/test_sweep_prefetch_engine.py")),
    "src/kvcanary/engine/scheduler.py": (3, ("retract", "postprocess"),
                                         ("tests/engine/test_scheduler.py::"
                                          "test_after_a_step_with_drafts_every_token_but_the_last_is_computed",
                                          *ENGINE_TESTS, "tests/engine/test_schedules.py")),
}
# the bugs the suite once let through, planted as they were: (file, text, its replacement, what)
CURATED = (
    (OPS + "_cpu_kernels.py", "bad = not (0 < slot < num_slots)", "bad = not (0 <= slot < num_slots)",
     "a real request's write into slot 0 is no BAD_ENTRY"),
    (OPS + "conflicts.py", "if held is not None and held.numel():", "if held is not None and held.numel() > 1:",
     "a single held slot is not checked"),
    (RT + "incidents.py", "return v.slot, int(reason)\n", "return v.slot, int(reason), v.point\n",
     "one slot at two launch points is two incidents"),
    ("src/kvcanary/engine/delivery.py", "if len(req.output_ids) < n:", "if len(req.output_ids) < n - 1:",
     "one retracted token is not counted"),
    (OPS + "publish.py", "    tl.store(row + 1 + j,", "    tl.store(row, s)\n    tl.store(row + 1 + j,",
     "the sequence word stored before the block"),
)
NUMBA_SOURCES = ("_cpu_kernels.py", "_cpu_scatter.py")
FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
COUNTISH = ("count", "num", "dropped", "retract", "total", "checked", "stamped", "len")


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    kind: str
    what: str
    start: int  # byte offsets of the replaced span in the file
    end: int
    text: str  # its replacement

    @property
    def numba(self) -> bool:
        return self.path.endswith(NUMBA_SOURCES) or self.what.startswith("module:")

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.text.encode() + source[self.end:]


class _Finder(ast.NodeVisitor):
    """The candidate mutants of one file, in the functions ``names`` (all when empty)."""

    def __init__(self, path: str, source: bytes, names: tuple[str, ...]):
        self.path, self.names, self.found, self.func = path, names, [], None
        self.starts = [0]
        for line in source.split(b"\n"):
            self.starts.append(self.starts[-1] + len(line) + 1)

    def _span(self, node) -> tuple[int, int]:
        return (self.starts[node.lineno - 1] + node.col_offset, self.starts[node.end_lineno - 1] + node.end_col_offset)

    def _add(self, node, kind: str, what: str, text: str) -> None:
        if self.names and self.func not in self.names:
            return
        start, end = self._span(node)
        where = self.func or "module"
        self.found.append(Mutant(self.path, node.lineno, kind, f"{where}: {what}", start, end, text))

    def visit_FunctionDef(self, node):
        outer, self.func = self.func, node.name if self.func is None else self.func
        body = node.body[1:] if ast.get_docstring(node) else node.body
        for stmt in body:
            self.visit(stmt)
        self.func = outer

    def visit_Raise(self, node):  # an error message is no detection logic
        return

    def visit_Assert(self, node):
        return

    def visit_JoinedStr(self, node):
        return

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("debug", "info", "warning", "error", "exception"):
            return  # logging
        self.generic_visit(node)

    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            if type(op) in FLIP:
                new = ast.Compare(node.left, list(node.ops), node.comparators)
                new.ops[i] = FLIP[type(op)]()
                self._add(node, "compare", f"{ast.unparse(node)} -> {ast.unparse(new)}", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        new = ast.BoolOp(other, node.values)
        self._add(node, "boolop", f"{_short(node)} -> {_short(new)}", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            self._add(node, "not", f"drop not: {_short(node)}", f"({ast.unparse(node.operand)})")
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if isinstance(node.op, ast.Add | ast.Sub) and any(_is_int(x) for x in (node.left, node.right)):
            new = ast.BinOp(node.left, ast.Sub() if isinstance(node.op, ast.Add) else ast.Add(), node.right)
            self._add(node, "arith", f"{_short(node)} -> {_short(new)}", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if _is_int(node) and node.value < 2**20:
            self._add(node, "constant", f"constant {node.value} -> {node.value + 1}", str(node.value + 1))

    def visit_AugAssign(self, node):
        if isinstance(node.op, ast.Add) and not _is_int(node.value, 0):
            self._add(node.value, "increment", f"drop increment: {_short(node)}", "0")
        self.generic_visit(node)

    def visit_Return(self, node):
        v = node.value
        name = (self.func or "").lower()
        called = v.func.id if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) else ""
        if v is not None and not isinstance(v, ast.Constant | ast.Tuple) and (
                any(k in name for k in COUNTISH) or called in ("len", "sum", "int")):
            self._add(v, "return", f"return {_short(v)} -> return 0", "0")
        self.generic_visit(node)

    def visit_If(self, node):
        if node.body and isinstance(node.body[0], ast.Raise):
            self._add(node.test, "guard", f"guard of a raise dropped: if {_short(node.test)}", "False")
        self.generic_visit(node)


def _is_int(node, value=None) -> bool:
    ok = isinstance(node, ast.Constant) and type(node.value) is int
    return ok and (value is None or node.value == value)


def _short(node) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 70 else text[:67] + "..."


def mutants(scale: float, seed: int) -> list[Mutant]:
    out = []
    for path, (quota, names, _) in TARGETS.items():
        source = (ROOT / path).read_bytes()
        finder = _Finder(path, source, names)
        finder.visit(ast.parse(source))
        seen, unique = set(), []
        for m in finder.found:
            if m.apply(source) not in seen:
                seen.add(m.apply(source))
                unique.append(m)
        random.Random(f"{seed}:{path}").shuffle(unique)
        by_kind: dict[str, list[Mutant]] = {}  # round robin over the kinds: not all constants
        for m in unique:
            by_kind.setdefault(m.kind, []).append(m)
        picked, quota = [], round(quota * scale)
        while len(picked) < quota and any(by_kind.values()):
            for kind in sorted(by_kind):
                if by_kind[kind] and len(picked) < quota:
                    picked.append(by_kind[kind].pop())
        out += sorted(picked, key=lambda m: (m.line, m.what))
    for path, old, new, what in CURATED:
        source = (ROOT / path).read_bytes()
        start = source.find(old.encode())
        assert start >= 0 and source.count(old.encode()) == 1, f"{path}: {old!r} is not there once"
        line = source[:start].count(b"\n") + 1
        out.append(Mutant(path, line, "curated", f"curated: {what}", start, start + len(old.encode()), new))
    return out


class Sandbox:
    """A copy of the repository where mutants are written one at a time."""

    def __init__(self, slack: float):
        self.dir = Path(tempfile.mkdtemp(prefix="kvcanary-mutation-"))
        self.slack = slack
        self.timeout: dict[tuple[str, ...], float] = {}  # test set -> seconds a mutant may take
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, self.dir / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy2(ROOT / "pyproject.toml", self.dir / "pyproject.toml")
        self.warm_cache = self.dir / ".numba-warm"

    def env(self, numba_cache: Path) -> dict:
        return {**os.environ, "PYTHONPATH": str(self.dir / "src"), "PYTHONDONTWRITEBYTECODE": "1",
                "NUMBA_CACHE_DIR": str(numba_cache), "TRITON_INTERPRET": "1"}

    def _run(self, cmd: list[str], env: dict, timeout: float) -> str:
        proc = subprocess.Popen(cmd, cwd=self.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return "timeout"
        return "passed" if proc.returncode == 0 else f"failed:{proc.returncode}:{out.decode()[-2000:]}"

    def pytest(self, tests: tuple[str, ...], numba_cache: Path, timeout: float | None = None) -> str:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        return self._run(cmd, self.env(numba_cache), timeout or self.timeout[tests])

    def baseline(self, tests: tuple[str, ...]) -> str:
        """Run ``tests`` unmutated (warming the shared numba cache); a mutant may then take
        ``slack`` times as long (at least a minute) before it counts as a timeout."""
        t = time.time()
        result = self.pytest(tests, self.warm_cache, timeout=1800)
        self.took = time.time() - t
        self.timeout[tests] = max(60.0, self.slack * self.took)
        return result

    def compiles(self, numba_cache: Path) -> bool:
        cmd = [sys.executable, "-c", "from kvcanary.ops import _cpu; assert _cpu.usable()"]
        return self._run(cmd, self.env(numba_cache), 600) == "passed"

    def run(self, m: Mutant) -> str:
        target = self.dir / m.path
        source, times = target.read_bytes(), target.stat()
        cache = Path(tempfile.mkdtemp(prefix="numba-", dir=self.dir)) if m.numba else self.warm_cache
        try:
            target.write_bytes(m.apply(source))
            if m.numba and not self.compiles(cache):
                return "invalid"
            result = self.pytest(TARGETS[m.path][2], cache)
        finally:
            target.write_bytes(source)
            os.utime(target, ns=(times.st_atime_ns, times.st_mtime_ns))
            if cache != self.warm_cache:
                shutil.rmtree(cache, ignore_errors=True)
        return "survived" if result == "passed" else "timeout" if result == "timeout" else "killed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="times each file's number of mutants")
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--slack", type=float, default=3.0, help="a mutant's tests may take this many times "
                    "their baseline's seconds (at least 60) before the mutant counts as a timeout")
    ap.add_argument("--list", action="store_true", help="list the mutants and stop")
    ap.add_argument("--only", type=int, nargs="*", help="run only these mutants (numbers of --list)")
    ap.add_argument("--no-baseline", type=float, metavar="SECONDS", help="skip the baselines (a rerun of a few "
                    "mutants): each mutant's tests then get SECONDS")
    args = ap.parse_args()
    found = mutants(args.scale, args.seed)
    chosen = [(i, m) for i, m in enumerate(found) if args.only is None or i in args.only]
    if args.list:
        for i, m in chosen:
            print(f"{i:3d} {m.path}:{m.line} {m.what}")
        return 0
    box = Sandbox(args.slack)
    for tests in sorted({TARGETS[m.path][2] for _, m in chosen}):  # each test set passes unmutated
        if args.no_baseline:
            box.timeout[tests] = args.no_baseline
            continue
        result = box.baseline(tests)
        print(f"baseline {result[:6]} {box.took:6.1f}s {' '.join(tests)}", flush=True)
        if result != "passed":
            print(result, file=sys.stderr)
            return 2
    outcome: dict[str, list] = {"killed": [], "survived": [], "timeout": [], "invalid": []}
    t0 = time.time()
    for i, m in chosen:
        t = time.time()
        result = box.run(m)
        outcome[result].append((i, m))
        print(f"{i:3d} {result:8s} {time.time() - t:6.1f}s {m.path}:{m.line} {m.what}", flush=True)
    valid = len(chosen) - len(outcome["invalid"])
    killed = len(outcome["killed"]) + len(outcome["timeout"])
    print(f"\nkilled {killed}/{valid} ({100 * killed / max(valid, 1):.1f} %; timeouts {len(outcome['timeout'])}, "
          f"invalid {len(outcome['invalid'])}) in {time.time() - t0:.0f} s")
    for i, m in outcome["survived"]:
        print(f"survived {i:3d} {m.path}:{m.line} {m.what}")
    shutil.rmtree(box.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
