"""The reference engine's canary share, two source trees against each other: ``engine_phases.py``
once per process, the trees alternating A B B A (a round), so a host that speeds up or slows down
during the sitting weighs on both trees alike.

    python3 benchmarks/engine_ab.py <tree A>/src <tree B>/src [--rounds 2] [--runs 3] [--device cuda] \
        [--raw ab.txt]

Each tree is a ``src`` folder (for example ``git archive <commit> src | tar -x -C <dir>``). Prints
one line a process (the canary-off run's median seconds, each mode's median share of its run's
wall time, each canary call's ms a run, and ``end_step``'s median µs a call after an eager step
and after replays), then per tree the median share of its processes with their range, and the
medians of the calls' figures. The share divides by the same process's wall
time; on a lent host the absolute figures move by tens of per cent from one process to the next,
so compare shares (BENCHMARKS.md: "one tree, two paths"). ``--raw`` keeps every process's output.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = Path(__file__).with_name("engine_phases.py")
MODES = ("partial", "none")
CALLS = ("end_step", "prepare_head", "sweep", "launch_head", "tail")
STEP_KINDS = ("eager", "replays")  # ``engine_phases.py``'s "canary.end_step after <kind>" lines
_RUNS = re.compile(r"^(off|partial|none) runs \(s, steps, canary s\): (\[.*\])$", re.M)


def parse(text: str) -> dict:
    """One ``engine_phases.py`` output: the off runs' median seconds, each mode's median share (%),
    and each canary call's ms a run (partial)."""
    out = {"calls": {}}
    for mode, runs in _RUNS.findall(text):
        rows = [tuple(float(x) for x in r.split(",")) for r in re.findall(r"\(([^)]*)\)", runs)]
        if mode == "off":
            out["off_s"] = statistics.median(s for s, _, _ in rows)
        else:
            out[mode] = statistics.median(100 * c / s for s, _, c in rows)
    for call in CALLS:
        m = re.search(rf"^canary\.{call}\s+\S+\s+\S+\s+\d+\s+(\S+)\s", text, re.M)
        if m:
            out["calls"][call] = float(m.group(1))
    out["end_step_us"] = {}  # median µs a call (partial) by the kind of step it ends, where printed
    for kind in STEP_KINDS:
        m = re.search(rf"^canary\.end_step after {kind}\s+\S+\s+\S+\s+\d+\s+\S+\s+(\S+)\s", text, re.M)
        if m:
            out["end_step_us"][kind] = float(m.group(1))
    if "off_s" not in out or any(m not in out for m in MODES):
        raise ValueError("engine_phases.py printed no runs for every mode:\n" + text[-2000:])
    return out


def run(tree: str, runs: int, device: str) -> str:
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run([sys.executable, str(PHASES), "--runs", str(runs), "--device", device], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--raw")
    args = ap.parse_args(argv)
    for tree in (args.a, args.b):
        if not (Path(tree) / "kvcanary").is_dir():
            raise SystemExit(f"tree {tree!r} holds no kvcanary package; pass a tree's src folder")
    got = {"A": [], "B": []}
    raw = []
    for i, name in enumerate(["A", "B", "B", "A"] * args.rounds, start=1):
        text = run(args.a if name == "A" else args.b, args.runs, args.device)
        raw.append(f"## {i} {name}\n{text}")
        r = parse(text)
        got[name].append(r)
        calls = " ".join(f"{c} {ms:.2f}" for c, ms in r["calls"].items())
        kinds = "".join(f" {k} {us:.1f}" for k, us in r["end_step_us"].items())
        print(f"{i:2d} {name}  off {r['off_s']:.3f} s  share partial {r['partial']:.2f} %  none {r['none']:.2f} %"
              f"  | ms a run: {calls}" + (f"  | end_step µs a call after:{kinds}" if kinds else ""), flush=True)
    if args.raw:
        Path(args.raw).write_text("".join(raw))
    for name, tree in (("A", args.a), ("B", args.b)):
        rs = got[name]
        shares = "  ".join(f"{m} {statistics.median(r[m] for r in rs):.2f} % "
                           f"[{min(r[m] for r in rs):.2f}-{max(r[m] for r in rs):.2f}]" for m in MODES)
        calls = " ".join(f"{c} {statistics.median(r['calls'][c] for r in rs):.2f}" for c in CALLS
                         if all(c in r["calls"] for r in rs))
        kinds = "".join(f" {k} {statistics.median(r['end_step_us'][k] for r in rs):.1f}" for k in STEP_KINDS
                        if all(k in r["end_step_us"] for r in rs))
        print(f"{name} ({tree}, {len(rs)} processes): share {shares}  | median ms a run: {calls}"
              + (f"  | median end_step µs a call after:{kinds}" if kinds else ""))


if __name__ == "__main__":
    main()
