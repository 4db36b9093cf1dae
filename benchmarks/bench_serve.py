"""``kv-canary serve`` under load, over real HTTP on 127.0.0.1.

    python benchmarks/bench_serve.py [--clients 1,8,32,64,256] [--seconds 15] [--rss-requests 10000]
                                     [--json PATH]

Starts ``kv-canary serve`` as a subprocess, then:
1. for each client count: that many clients send completions in a closed loop for ``--seconds``
   (16-byte prompts, 32 tokens each) while one poller reads ``/metrics`` and ``/canary/status``
   every 50 ms; reports tokens/s, request latency p50/p99, admin and metrics p99, any non-200;
2. RSS of the server after a warm-up of 1000 requests and after ``--rss-requests`` more (64
   clients, 4 tokens each): the growth per 10k requests;
3. SIGTERM with 64 requests of 512 tokens in flight: seconds to exit, exit code, answers by status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvcanary", "serve", "--port", str(port), "--max-ctx", "1024",
                             "--num-slots", "8192", "--max-queued", "4096", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start: {proc.stderr.read().decode()[-2000:]}")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def prompt(i: int) -> str:
    return f"req {i:08d} canary"[:16]


class RawClient:
    """One keep-alive HTTP/1.1 connection speaking just enough HTTP for JSON POSTs: far cheaper
    per request than httpx, so one process can drive hundreds of clients without becoming the
    bottleneck it measures."""

    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return status, json.loads(await self.reader.readexactly(length))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def poll(base: str, seconds: float) -> tuple[list[float], list[float], list[int]]:
    """Read /canary/status and /metrics every 50 ms for ``seconds``: their latencies, and the
    requests in flight each status read saw."""
    status, metrics, in_flight = [], [], []
    stop = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=60) as c:
        c.get("/metrics"), c.get("/canary/status")  # connect first: the figures are of reads, not of set-up
        while time.monotonic() < stop:
            for path, out in (("/metrics", metrics), ("/canary/status", status)):
                t0 = time.perf_counter()
                r = c.get(path)
                out.append(time.perf_counter() - t0)
                if path == "/canary/status":
                    in_flight.append(r.json()["engine"]["in_flight"])
            time.sleep(0.05)
    return status, metrics, in_flight


async def load(base: str, port: int, clients: int, seconds: float, max_tokens: int = 32) -> dict:
    latencies, tokens, bad = [], 0, {}
    stop = time.monotonic() + seconds

    async def client(k: int) -> None:
        nonlocal tokens
        c, i = RawClient(port), 0
        try:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    status, body = await c.post("/v1/completions", {"prompt": prompt(k * 100000 + i),
                                                                    "max_tokens": max_tokens})
                except (OSError, asyncio.IncompleteReadError) as e:
                    bad[type(e).__name__] = bad.get(type(e).__name__, 0) + 1
                    c = RawClient(port)
                    continue
                if status == 200:
                    latencies.append(time.perf_counter() - t0)
                    tokens += body["usage"]["completion_tokens"]
                else:
                    bad[status] = bad.get(status, 0) + 1
                i += 1
        finally:
            await c.close()

    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its own process: client-side lag stays out
        polled = pool.apply_async(poll, (base, seconds))
        await asyncio.gather(*(client(k) for k in range(clients)))
        admin, metrics, in_flight = polled.get()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(latencies), "tokens_per_s": round(tokens / wall, 1),
            "latency_p50_s": round(pct(latencies, 0.5), 4), "latency_p99_s": round(pct(latencies, 0.99), 4),
            "metrics_p50_ms": round(1e3 * pct(metrics, 0.5), 2), "metrics_p99_ms": round(1e3 * pct(metrics, 0.99), 2),
            "status_p50_ms": round(1e3 * pct(admin, 0.5), 2), "status_p99_ms": round(1e3 * pct(admin, 0.99), 2),
            "admin_reads": len(admin) + len(metrics), "median_in_flight": statistics.median(in_flight or [0]),
            "non_200": bad}


async def many(port: int, n: int, clients: int = 64) -> tuple[int, int]:
    """``n`` short completions from ``clients`` clients: (answered 200, transport errors)."""
    done, errors = 0, 0

    async def worker(k: int) -> None:
        nonlocal done, errors
        c = RawClient(port)
        for i in range(k, n, clients):
            try:
                status, _ = await c.post("/v1/completions", {"prompt": prompt(i), "max_tokens": 4})
                done += status == 200
            except (OSError, asyncio.IncompleteReadError):
                errors += 1
                c = RawClient(port)
        await c.close()

    await asyncio.gather(*(worker(k) for k in range(clients)))
    return done, errors


def rss_mb(proc: subprocess.Popen) -> float:
    return psutil.Process(proc.pid).memory_info().rss / 2**20


async def sigterm(base: str, proc: subprocess.Popen, n: int = 64, max_tokens: int = 512) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=httpx.Limits(max_connections=n + 4)) as c:
        tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": prompt(i), "max_tokens": max_tokens}))
                 for i in range(n)]
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        proc.terminate()
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        code = await asyncio.to_thread(proc.wait, 60)
        took = time.monotonic() - t0
    by_status: dict[str, int] = {}
    for a in answers:
        key = str(a.status_code) if isinstance(a, httpx.Response) else type(a).__name__
        by_status[key] = by_status.get(key, 0) + 1
    return {"in_flight": n, "max_tokens": max_tokens, "exit_code": code, "seconds_to_exit": round(took, 2),
            "answers": by_status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,32,64,256")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rss-requests", type=int, default=10_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": []}
    proc = start_server(port)
    try:
        asyncio.run(many(port, 200, 16))  # warm-up
        for n in (int(x) for x in args.clients.split(",")):
            row = asyncio.run(load(base, port, n, args.seconds))
            print(json.dumps(row), flush=True)
            out["load"].append(row)
        asyncio.run(many(port, 1000))
        before = rss_mb(proc)
        t0 = time.perf_counter()
        ok, errors = asyncio.run(many(port, args.rss_requests))
        after = rss_mb(proc)
        out["rss"] = {"requests": args.rss_requests, "ok": ok, "transport_errors": errors,
                      "seconds": round(time.perf_counter() - t0, 1),
                      "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
                      "growth_mb_per_10k": round((after - before) * 10_000 / args.rss_requests, 2)}
        print(json.dumps(out["rss"]), flush=True)
        out["sigterm"] = asyncio.run(sigterm(base, proc))
        print(json.dumps(out["sigterm"]), flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
