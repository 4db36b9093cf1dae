"""Hugging Face transformers continuous batching: generation throughput with the canary on vs off.

    python benchmarks/bench_transformers.py [--device cpu|cuda] [--repeats 3] [--json PATH] [--cuda-graph]

A randomly initialised Llama of a small shape (``--shape small``: 8 layers, hidden 1024, 16 query /
8 KV heads of 64 dims; ``--shape tiny``: the CI model) generates greedily for a seeded workload
(prompts sharing a system prompt, so the prefix cache serves part of every prefill) through the
manager API (``init_continuous_batching``; the manager is created and warmed up before the clock
starts). Each repeat runs the canary off, then on (log policy, partial fingerprints, sweeps every
8 steps), alternating which goes first; the figure is the median tokens/s ratio on/off. Outputs
must be identical on and off and the canary must report nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvcanary.adapters.transformers import install, page_size_option
from kvcanary.bench.timing import environment
from kvcanary.config import CanaryConfig, Policy
from kvcanary.ops.fingerprint import FingerprintMode

SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64),
}


def build_model(shape: str, device: str, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def workload(vocab: int, n: int, system_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, vocab, (system_len,), generator=g).tolist()
    return [system + torch.randint(1, vocab, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run_once(model, prompts, args, canary_on: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(**page_size_option(args.page_size), num_blocks=args.num_blocks,
                                  max_batch_tokens=args.max_batch_tokens, use_async_batching=False,
                                  use_cuda_graph=args.cuda_graph)
    kv = install(model, CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode.PARTIAL, sweep_interval=8),
                 max_ctx=model.config.max_position_embeddings) if canary_on else None
    try:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.warmup()
        manager.start()
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            manager.add_request(input_ids=p, request_id=f"req_{i}", max_new_tokens=args.max_new_tokens)
        results = {}
        while len(results) < len(prompts) and manager.is_running():
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = list(out.generated_tokens)
        if kv is not None:
            kv.flush()
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        manager.stop(block=True)
    finally:
        if kv is not None:
            kv.uninstall()
    tokens = sum(map(len, results.values()))
    return {"mode": "on" if canary_on else "off", "seconds": dt, "tokens": tokens, "tok_per_s": tokens / dt,
            "violations": len(kv.violations) if kv else 0, "canary_seconds": kv.totals()["seconds"] if kv else 0.0,
            "stats": kv.stats.as_dict() if kv else {}, "outputs": results}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on cuda, tiny on cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--cuda-graph", action="store_true", help="let transformers capture CUDA graphs (CUDA only)")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "bench_transformers.json") if "OUT" in os.environ
                    else None)
    args = ap.parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        ap.error(f"--cuda-graph needs --device cuda, got --device {args.device}")
    shape = args.shape or ("small" if args.device == "cuda" else "tiny")
    max_len = -(-(args.system_len + 64 + args.max_new_tokens) // args.page_size) * args.page_size
    model = build_model(shape, args.device, max_len)
    prompts = workload(model.config.vocab_size, args.requests, args.system_len)
    run_once(model, prompts[:4], args, False)  # warm-up (allocator, kernels)
    run_once(model, prompts[:4], args, True)
    runs = []
    for r in range(args.repeats):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            runs.append(run_once(model, prompts, args, on))
    ref = runs[0]["outputs"]
    identical = all(x["outputs"] == ref for x in runs)
    med = {m: statistics.median(x["tok_per_s"] for x in runs if x["mode"] == m) for m in ("off", "on")}
    share = statistics.median(x["canary_seconds"] / x["seconds"] for x in runs if x["mode"] == "on")
    violations = sum(x["violations"] for x in runs)
    env = environment(torch.device(args.device))
    import transformers

    on_stats = next(x["stats"] for x in runs if x["mode"] == "on")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "shape": shape, "environment": env,
                       "transformers": transformers.__version__, "args": vars(args),
                       "runs": [{k: v for k, v in x.items() if k != "outputs"} for x in runs],
                       "median_tok_per_s": med, "ratio_on_off": med["on"] / med["off"], "canary_share": share,
                       "violations": violations, "outputs_identical": identical}, f, indent=1)
    print(f"device {env['device_name']}; transformers {transformers.__version__}; shape {shape}; {args.requests} "
          f"requests x {args.max_new_tokens} new tokens; {args.repeats} interleaved repeats; cuda graph "
          f"{'on' if args.cuda_graph else 'off'}; prefix-hit tokens per run {on_stats['prefix_hit_tokens']}")
    print(f"{'canary':8} {'tok/s':>9} {'on/off':>7} {'canary share':>12} {'violations':>10} {'identical':>9}")
    print(f"{'off':8} {med['off']:9.1f} {1.0:7.3f} {0.0:12.3f} {0:10d} {str(identical):>9}")
    print(f"{'on':8} {med['on']:9.1f} {med['on'] / med['off']:7.3f} {share:12.3f} {violations:10d} {str(identical):>9}")
    if violations or not identical:
        raise SystemExit("FAIL: the canary reported violations or changed the outputs")


if __name__ == "__main__":
    main()
