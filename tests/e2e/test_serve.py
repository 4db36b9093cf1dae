"""``kv-canary serve`` over real HTTP on 127.0.0.1: the official ``openai`` client completes text and
token-id prompts, a real Prometheus server (Debian's ``prometheus``) scrapes ``/metrics`` every
second, and the violation counter rises at the injected fault's reason and launch point (it stays
at 0 before the injection). The server's ``--log-json`` violation line is parsed."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

TOKEN = "e2e-t0ken"
FINGERPRINT_TAIL = 'kvcanary_violations_total{reason="fingerprint",launch_point="TAIL"}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log=None):
    """Poll ``check()`` until it returns a truthy value (returned) or ``timeout`` seconds pass (fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}: {log.read_text()[-2000:] if log else ''}")
        try:
            value = check()
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout} s" + (f"; log: {log.read_text()[-2000:]}" if log else ""))


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _start(argv: list[str], log) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def stack(tmp_path):
    """``kv-canary serve`` and a Prometheus scraping it every second, started side by side; yields
    (server url, server process, server log, prometheus url)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus server is not installed (apt-get install prometheus; .ci/run does)")
    port, prom_port = _free_port(), _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvcanary", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }))
    log, prom_log = tmp_path / "server.log", tmp_path / "prometheus.log"
    procs = []
    try:
        procs.append(_start([sys.executable, "-m", "kvcanary", "--log-json", "serve", "--port", str(port),
                             "--admin-token", TOKEN, "--enable-faults", "--sweep-interval", "2", "--num-slots", "1024",
                             "--max-ctx", "256"], log))
        procs.append(_start([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], prom_log))
        base, prom = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
        _wait("kv-canary serve", lambda: httpx.get(f"{base}/canary/status", timeout=2).status_code == 200, 90,
              procs[0], log)
        _wait("prometheus ready", lambda: httpx.get(f"{prom}/-/ready", timeout=2).status_code == 200, 60, procs[1],
              prom_log)
        yield base, procs[0], log, prom
    finally:
        for proc in procs:
            _stop(proc)


def _query(prom: str, expr: str) -> list[float]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    return [float(s["value"][1]) for s in r.json()["data"]["result"]]


def test_openai_client_and_prometheus_see_an_injected_fault(stack):
    base, proc, log, prometheus = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="kv-canary-reference", prompt="The canary sings when", max_tokens=6)
    assert len(out.choices) == 1 and isinstance(out.choices[0].text, str)
    assert out.usage.prompt_tokens == len(b"The canary sings when") and out.usage.completion_tokens == 6
    out = client.completions.create(model="kv-canary-reference", prompt=[[17, 4, 99, 250, 3], [8, 61, 200]],
                                    max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="token ids in"):
        client.completions.create(model="kv-canary-reference", prompt=[[5, 300]], max_tokens=2)

    # scraped, and clean so far: the labelled series exist at 0
    assert _wait("first scrape", lambda: _query(prometheus, FINGERPRINT_TAIL), 30) == [0.0]
    assert _query(prometheus, 'up{job="kvcanary"}') == [1.0]
    assert _query(prometheus, "sum(kvcanary_violations_total)") == [0.0]
    _wait("a scrape after the completions", lambda: [v for v in _query(prometheus, "kvcanary_stamped_slots_total")
                                                       if v > 0], 30)
    assert _query(prometheus, "sum(kvcanary_violations_total)") == [0.0]

    r = httpx.post(f"{base}/canary/faults/used_slot_flip", json={"seed": 11}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(f"{base}/canary/faults/used_slot_flip", json={"seed": 11},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    client.completions.create(model="kv-canary-reference", prompt=["one more request", "and another"], max_tokens=8)

    risen = _wait("violation counter rises", lambda: [v for v in _query(prometheus, FINGERPRINT_TAIL) if v > 0], 30)
    assert risen[0] >= 1
    assert _query(prometheus, 'sum(kvcanary_violations_total{reason!="fingerprint"})') == [0.0]
    injections = httpx.get(f"{base}/canary/faults", headers={"Authorization": f"Bearer {TOKEN}"}).json()["injections"]

    _stop(proc)
    assert f"kv-canary serve: {base}/v1/completions" in log.read_text()  # bound to 127.0.0.1 without --host
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    violations = [x for x in lines if x.get("event") == "violation"]
    assert violations, log.read_text()[-2000:]
    first = violations[0]["fields"]
    half = re.search(r" half=([KV]) ", injections[0]["detail"])[1]  # the tag names the half the fault flipped
    assert (first["tag"], first["reason"], first["slot"]) == (f"TAIL.FULL.{half}", "fingerprint",
                                                              injections[0]["slot"])
    assert violations[0]["logger"] == "kvcanary" and violations[0]["level"] == "WARNING"


def test_sigterm_under_load_drains_then_exits_0(tmp_path):
    """SIGTERM with 24 long requests in flight: a short one finishes, the rest are answered 503
    with a JSON error after the drain, and the process exits 0 within 10 s of the signal."""
    import asyncio

    port, log = _free_port(), tmp_path / "server.log"
    proc = _start([sys.executable, "-m", "kvcanary", "serve", "--port", str(port), "--drain-timeout", "1",
                   "--max-ctx", "1024"], log)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait("kv-canary serve", lambda: httpx.get(f"{base}/health", timeout=2).status_code == 200, 90, proc, log)

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
                body = lambda i, n: {"prompt": f"request {i}", "max_tokens": n}
                tasks = [asyncio.create_task(c.post("/v1/completions", json=body(i, 900))) for i in range(24)]
                short = asyncio.create_task(c.post("/v1/completions", json=body(99, 2)))
                await asyncio.sleep(1.0)
                t0 = time.monotonic()
                proc.terminate()
                answers = await asyncio.gather(short, *tasks, return_exceptions=True)
                code = await asyncio.to_thread(proc.wait, 20)
                return answers, code, time.monotonic() - t0

        answers, code, took = asyncio.run(main())
    finally:
        if proc.poll() is None:
            _stop(proc)
    assert code == 0 and took < 10, (code, took, log.read_text()[-2000:])
    assert answers[0].status_code == 200
    statuses = [a.status_code for a in answers[1:]]
    assert set(statuses) <= {200, 503} and statuses.count(503) >= 1, statuses
    refused = [a.json()["error"] for a in answers[1:] if a.status_code == 503]
    assert all(e["type"] == "unavailable_error" and "shutting down" in e["message"] for e in refused)


def test_binding_beyond_loopback_needs_a_token():
    out = subprocess.run([sys.executable, "-m", "kvcanary", "serve", "--host", "0.0.0.0", "--port", "1"],
                         capture_output=True, text=True, timeout=60)
    text = " ".join(out.stderr.replace("\u2502", " ").split())  # the message as one line, without its box
    assert out.returncode == 2 and "without --admin-token" in text and "--allow-no-token" in text, text


@pytest.mark.parametrize("on_violation", ["fail-requests", "stop"])
def test_raise_policy_fails_the_reader_or_stops_as_told(tmp_path, on_violation):
    """``--policy raise``: the request that reads an injected flip fails with 500 and the server
    keeps serving (``/health`` ok); with ``--on-violation stop`` it answers 503 from then on."""
    port, log = _free_port(), tmp_path / "server.log"
    proc = _start([sys.executable, "-m", "kvcanary", "serve", "--port", str(port), "--policy", "raise",
                   "--on-violation", on_violation, "--admin-token", TOKEN, "--enable-faults", "--num-slots", "1024",
                   "--max-ctx", "256"], log)
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    try:
        _wait("kv-canary serve", lambda: httpx.get(f"{base}/health", timeout=2).status_code == 200, 90, proc, log)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "warm", "max_tokens": 4}, timeout=60).status_code \
            == 200
        assert httpx.post(f"{base}/canary/faults/used_slot_flip", json={"seed": 11}, headers=auth).status_code == 200
        victim = httpx.post(f"{base}/v1/completions", json={"prompt": "reads the flip", "max_tokens": 8}, timeout=60)
        health = httpx.get(f"{base}/health", timeout=10)
        later = httpx.post(f"{base}/v1/completions", json={"prompt": "later", "max_tokens": 4}, timeout=60)
    finally:
        _stop(proc)
    error = victim.json()["error"]["message"]
    assert "fingerprint at TAIL" in error, error
    if on_violation == "fail-requests":
        assert (victim.status_code, health.status_code, later.status_code) == (500, 200, 200)
    else:
        assert (victim.status_code, health.status_code, later.status_code) == (503, 503, 503)
        assert health.json()["status"] == "stopped"


def test_on_violation_stop_needs_the_raise_policy():
    out = subprocess.run([sys.executable, "-m", "kvcanary", "serve", "--port", "1", "--on-violation", "stop"],
                         capture_output=True, text=True, timeout=60)
    text = " ".join(out.stderr.replace("\u2502", " ").split())
    assert out.returncode == 2 and "stop acts under --policy raise only, got --policy log" in text, text
