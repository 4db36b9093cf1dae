"""Host µs of the reference engine's ``build_forward_batch``, token truth on (appends, as with a
canary) and off, at decode and prefill shapes with short and long histories.

    PYTHONPATH=src python3 benchmarks/forward_batch_build.py [--shapes decode:16x100,prefill:12x100]
                                                             [--device cpu|cuda] [--repeats 5] [--number 200]
                                                             [--json PATH]

A shape is ``decode:BSxCTX`` (BS requests, each writing its one next token after a history of CTX
tokens: 10 outputs after a prompt of CTX - 10) or ``prefill:BSxLEN`` (BS requests prefilling
prompts of LEN tokens into rows new to the truth: the whole prompt appended). The batch is built
on the CPU (the device copy is not timed: it is one copy either way). Each cell is the best of
``--repeats`` loops of ``--number`` builds, µs a build, warm caches: the work itself, not what it
costs between a model's launches (``engine_phases.py`` times that, in the engine). "truth" is the
on - off difference: what the canary's token truth adds to a batch.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit

import torch

from kvcanary.engine.forward_batch import build_forward_batch
from kvcanary.engine.request import Request

DEFAULT = "decode:16x100,decode:16x4000,prefill:12x100,prefill:4x4000"


def parse(spec: str) -> tuple[str, int, int]:
    kind, _, size = spec.partition(":")
    bs, _, n = size.partition("x")
    if kind not in ("decode", "prefill") or not (bs.isdigit() and n.isdigit()) or int(bs) < 1 or int(n) < 11:
        raise SystemExit(f"shape {spec!r}: decode:BSxCTX or prefill:BSxLEN, BS >= 1, CTX and LEN >= 11")
    return kind, int(bs), int(n)


def requests(kind: str, bs: int, n: int, rng: random.Random) -> list[tuple[Request, int]]:
    plan = []
    for i in range(bs):
        if kind == "decode":
            req = Request(i, [rng.randrange(512) for _ in range(n - 10)], 64,
                          output_ids=[rng.randrange(512) for _ in range(10)], row=i + 1)
            req.num_cached = req.num_tokens - 1
            plan.append((req, 1))
        else:
            plan.append((Request(i, [rng.randrange(512) for _ in range(n)], 64, row=i + 1), n))
    return plan


def time_shape(spec: str, repeats: int, number: int, device: str = "cpu") -> dict:
    kind, bs, n = parse(spec)
    plan = requests(kind, bs, n, random.Random(bs * 7919 + n))
    table = torch.zeros(bs + 1, n + 64, dtype=torch.int32, device=device)
    starts = [req.num_cached if kind == "decode" else 0 for req, _ in plan]

    def build(truth: bool) -> None:
        for (req, _), s in zip(plan, starts, strict=True):
            req.truth_len = s
        build_forward_batch(plan, table, appends=True, truth=truth)

    row = {"shape": spec}
    for truth, name in ((False, "off"), (True, "on")):
        build(truth)
        row[name + " µs"] = min(timeit.repeat(lambda t=truth: build(t), number=number, repeat=repeats)) / number * 1e6
    row["truth µs"] = row["on µs"] - row["off µs"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [time_shape(s, args.repeats, args.number, args.device) for s in args.shapes.split(",")]
    print("| shape | off µs | on µs | truth µs |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['off µs']:.1f} | {r['on µs']:.1f} | {r['truth µs']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
