"""Per-step cost of the tensor-parallel agreement against a tensor-parallel step, per batch size,
under log (table read one step late) and under recompute (table joined before sampling).

    # two GPUs, one process each (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_agreement.py --device cuda
    # one GPU, world size 1 (NCCL): the captured row, digest and all-reduce on their own
    PYTHONPATH=src python3 benchmarks/bench_agreement.py --device cuda --nproc 1
    # CPU, gloo, tiny sizes (what the test runs)
    PYTHONPATH=src python3 benchmarks/bench_agreement.py --device cpu --nproc 2 --hidden 64 --layers 2 \\
        --num-slots 4096 --steps 10 --blocks 3

Each rank holds a canary (``Policy.LOG``) of a ``--num-slots`` pool and a decode batch of ``bs``
requests with stamped-looking records. The step is a synthetic tensor-parallel forward: per
layer a column- and a row-parallel matmul of the hidden state and an all-reduce of it, then a
"sample" (the step's output read by the host, as sampling does). Two modes, interleaved in
blocks of ``--steps`` steps:

- ``base``: the step + ``Canary.end_step``;
- ``agreed``: ``RankAgreement`` around the same step: its device half (``signal_row`` + the
  all-reduce of the table) issued after the HEAD point, ``launched`` and ``end_step``. The
  all-reduce uses the model's process group, or its own with ``--own-group``.

On CUDA both modes are captured in CUDA graphs (``--eager`` to run them eagerly): the base graph
holds the forward, the agreed one the signal's device half too (joined at the end), so what the
agreement adds outside the graph is its host half. On the CPU (gloo) everything runs eagerly.
The cost is the difference of the median step times; also reported: the agreement's host µs per
step (``RankAgreement.seconds``). Writes JSON (``--json``) and prints a table (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcanary.config import CanaryConfig, Policy
from kvcanary.distributed import RankAgreement
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

POLICIES = {"log": Policy.LOG, "recompute": Policy.RECOMPUTE}


@dataclass(frozen=True)
class Args:
    device: str
    batch_sizes: tuple[int, ...]
    policies: tuple[str, ...]
    hidden: int
    layers: int
    num_slots: int
    steps: int
    blocks: int
    eager: bool
    own_group: bool


def decode_batch(bs: int, num_slots: int, device: torch.device, gen: torch.Generator) -> ForwardBatch:
    """bs decode requests on rows 1..bs, each writing one fresh slot at position 100."""
    slots = torch.randperm(num_slots - 1, generator=gen)[:bs] + 1
    table = torch.zeros(bs + 1, 128, dtype=torch.int32)
    table[1:, 100] = slots.int()
    n = lambda v: torch.full((bs,), v, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(torch.arange(1, bs + 1).to(device), n(100).to(device), n(1).to(device), table.to(device),
                        torch.randint(0, 32000, (bs,), generator=gen).to(device), n(100).to(device), slots.to(device),
                        request_ids=tuple(range(bs)))


class Step:
    """The synthetic TP forward and its "sample" (a host read of the output)."""

    def __init__(self, args: Args, bs: int, world: int, device: torch.device, gen: torch.Generator):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        shard = max(args.hidden // world, 1)
        self.w_in = (torch.randn(args.hidden, shard, generator=gen) * 0.01).to(device, dtype)
        self.w_out = (torch.randn(shard, args.hidden, generator=gen) * 0.01).to(device, dtype)
        self.x = torch.randn(bs, args.hidden, generator=gen).to(device, dtype)
        self.layers = args.layers
        self.out = torch.zeros(bs, dtype=torch.float32, device=device)

    def forward(self) -> None:
        x = self.x
        for _ in range(self.layers):
            y = (x @ self.w_in) @ self.w_out
            dist.all_reduce(y)
            x = x + y
        self.out.copy_(x[:, 0].float())

    def sample(self) -> float:
        return float(self.out[0])


def measure(args: Args, bs: int, policy: str, rank: int, world: int, device: torch.device) -> dict:
    is_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    gen = torch.Generator().manual_seed(1000 * bs)  # the same records and batch on every rank: digests agree
    config = CanaryConfig(policy=Policy.LOG, sweep_interval=0, watchdog_window=1 << 30)  # no HEAD runs here
    canary = Canary(config, PoolGeometry(args.num_slots, bs + 1, 128, str(device)))
    words = canary.state.records.view(torch.int64)
    words.copy_(torch.randint(0, 2**62, words.shape, generator=gen).to(device))
    group = dist.new_group(list(range(world))) if args.own_group else None  # own communicator: own NCCL stream
    agreement = RankAgreement(canary, POLICIES[policy], group)
    batch = decode_batch(bs, args.num_slots, device, gen)
    step = Step(args, bs, world, device, torch.Generator().manual_seed(rank))
    graphs, graph_error = None, None
    for warm in range(3):  # eager warm-up: compiles the kernels, initialises the communicators
        agreement.launch(warm, batch)
        step.forward()
        agreement.end_step(warm)
    agreement.finish(3)
    sync()
    if is_cuda and not args.eager:
        try:
            graphs = capture(step, agreement, batch)
        except Exception as e:  # noqa: BLE001 - reported in the JSON; the eager path still measures
            graph_error = f"{type(e).__name__}: {e}"
            sync()

    def run_base(s: int) -> None:
        if graphs:
            graphs[0].replay()
        else:
            step.forward()
        canary.end_step(s)
        step.sample()

    def run_agreed(s: int) -> None:
        if graphs:
            agreement.prepare(s)
            graphs[1].replay()
            agreement.launched(s, batch, replayed=True)
        else:
            agreement.launch(s, batch)
            step.forward()
        agreement.end_step(s)
        step.sample()

    times: dict[str, list[float]] = {"base": [], "agreed": []}
    s, host0 = 10, 0.0
    for block in range(args.blocks + 1):  # block 0 warms up
        for mode, run in (("base", run_base), ("agreed", run_agreed)):
            sync()
            dist.barrier()
            if mode == "agreed" and block == 1:
                host0 = agreement.seconds
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run(s)
                s += 1
            sync()
            if block:
                times[mode].append((time.perf_counter() - t0) / args.steps)
    host = (agreement.seconds - host0) / (args.blocks * args.steps)
    agreement.finish(s)
    sync()
    base, agreed = statistics.median(times["base"]), statistics.median(times["agreed"])
    return {"bs": bs, "policy": policy, "lag": agreement.lag, "graph": graphs is not None, "graph_error": graph_error,
            "base_us": base * 1e6, "agreed_us": agreed * 1e6, "cost_us": (agreed - base) * 1e6,
            "cost_pct": 100 * (agreed - base) / base, "agreement_host_us": host * 1e6,
            "divergences": len(agreement.divergences),
            "base_blocks_us": [t * 1e6 for t in times["base"]], "agreed_blocks_us": [t * 1e6 for t in times["agreed"]]}


def capture(step: Step, agreement: RankAgreement, batch: ForwardBatch):
    """(base graph, agreed graph): the forward; the signal's device half + the forward + join."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture warm-up on a side stream, as torch.cuda.graphs advises
        step.forward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    base, agreed = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(base):
        step.forward()
    with torch.cuda.graph(agreed):
        agreement.issue(batch)
        step.forward()
        agreement.join()
    torch.cuda.synchronize()
    return base, agreed


def rank_main(rank: int, world: int, args: Args, port: int | None, out: str) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
        rows = [measure(args, bs, p, rank, world, device) for bs in args.batch_sizes for p in args.policies]
        if rank == 0:
            env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "backend": backend, "world": world, "torch": torch.__version__}
            with open(out, "w") as f:
                json.dump({"environment": env, "args": asdict(args), "rows": rows}, f, indent=2)
            print_table(env, args, rows)
    finally:
        dist.destroy_process_group()


def print_table(env: dict, args: Args, rows: list[dict]) -> None:
    print(f"\n{env['device']} x{env['world']}, {env['backend']}, torch {env['torch']}; TP step: {args.layers} layers "
          f"x hidden {args.hidden}; median of {args.blocks} blocks of {args.steps} steps (rank 0)")
    print(f"{'bs':>5} {'policy':>9} {'lag':>3} {'graph':>5} {'TP step us':>11} {'with agreement':>15} "
          f"{'cost us':>8} {'cost %':>7} {'host us':>8}")
    for r in rows:
        print(f"{r['bs']:>5} {r['policy']:>9} {r['lag']:>3} {'yes' if r['graph'] else 'no':>5} {r['base_us']:>11.1f} "
              f"{r['agreed_us']:>15.1f} {r['cost_us']:>8.1f} {r['cost_pct']:>6.1f}% {r['agreement_host_us']:>8.1f}")
        if r["graph_error"]:
            print(f"      capture failed, measured eagerly: {r['graph_error']}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (ignored under torchrun); "
                    "default: every GPU with --device cuda, 2 on the CPU")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--policies", default="log,recompute")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-slots", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks per mode (interleaved)")
    ap.add_argument("--eager", action="store_true", help="on CUDA: no graph capture")
    ap.add_argument("--own-group", action="store_true", help="the agreement's all-reduce on its own process group "
                    "(NCCL: its own communicator and stream, so the model's all-reduces do not queue behind it)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_agreement.json"))
    a = ap.parse_args(argv)
    policies = tuple(a.policies.split(","))
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"--policies {bad} not in {sorted(POLICIES)}")
    args = Args(a.device, tuple(int(b) for b in a.batch_sizes.split(",")), policies, a.hidden, a.layers, a.num_slots,
                a.steps, a.blocks, a.eager, a.own_group)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, a.json)
        return
    nproc = a.nproc or (torch.cuda.device_count() if a.device == "cuda" else 2)
    if a.device == "cuda" and torch.cuda.device_count() < nproc:
        raise SystemExit(f"--nproc {nproc} needs {nproc} CUDA devices, found {torch.cuda.device_count()}")
    mp.spawn(rank_main, args=(nproc, args, free_port(), a.json), nprocs=nproc, join=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
