"""Every admin route through FastAPI's TestClient on the served reference engine: status codes,
auth, refusal of fault injection when disabled, bad input, and detection through the routes (a
flipped idle cached slot found by POST /canary/sweep; an injected fault found by the engine)."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.engine.config import EngineConfig
from kvcanary.faults.base import flip_bit
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.server.admin import AdminConfig, AdminTarget, CanaryAdmin, ViolationLog, admin_app
from kvcanary.server.app import build_app
from kvcanary.server.service import ServeConfig, ServeLimits

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(token: str | None = TOKEN, faults: bool = True, policy: Policy = Policy.LOG):
    config = ServeConfig(engine=EngineConfig(num_slots=512, max_ctx=256, chunk_size=32, host_tier_slots=256),
                         canary=CanaryConfig(policy=policy, sweep_interval=4),
                         admin=AdminConfig(token=token, enable_faults=faults), limits=ServeLimits(request_timeout_s=60))
    return TestClient(build_app(config), base_url="http://127.0.0.1:8000")


@pytest.fixture
def client():
    with _client() as c:
        yield c


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=gen).tolist() for k in torch.randint(6, 30, (n,), generator=gen)]


def _complete(client, prompt, max_tokens: int = 6):
    r = client.post("/v1/completions", json={"model": "kv-canary-reference", "prompt": prompt,
                                             "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def _error(r, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for f in fragments:
        assert f in message, message


def test_status_reports_config_totals_and_watchdog(client):
    _complete(client, _prompts(2, 0))
    s = client.get("/canary/status").json()
    assert s["config"]["policy"] == "log" and s["config"]["sweep_interval"] == 4
    assert s["admin"] == {"auth": True, "faults_enabled": True}
    assert s["totals"]["steps"] >= 6 and s["totals"]["violations"] == 0 and s["last_violations"] == []
    assert s["counters"]["HEAD"]["stamped"] > 0 and s["counters"]["HEAD"]["launches"] == s["engine"]["step"]
    assert s["watchdog"]["state"] == "ok" and s["watchdog"]["window"] > 0 and s["engine"]["stopped"] is None


def test_completions_text_and_token_ids(client):
    out = _complete(client, "héllo, canary", 5)
    assert out["object"] == "text_completion" and len(out["choices"]) == 1
    assert out["usage"] == {"prompt_tokens": len("héllo, canary".encode()), "completion_tokens": 5,
                            "total_tokens": len("héllo, canary".encode()) + 5}
    assert out["choices"][0]["finish_reason"] == "length" and isinstance(out["choices"][0]["text"], str)
    prompts = _prompts(3, 1)
    out = _complete(client, prompts, 4)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert client.get("/v1/models").json()["data"][0]["id"] == "kv-canary-reference"


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"prompt": ""}, 400, "prompt[0]: must be non-empty"),
    ({"prompt": []}, 400, "prompt: must not be empty"),
    ({"prompt": [3, 999]}, 400, "token ids in [0, 256)"),
    ({"prompt": "x" * 300, "max_tokens": 4}, 400, "exceeds max_ctx (256)"),
    ({"prompt": "hi", "n": 2}, 400, "only n=1"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens: must be an int in [1, 1024], got 0"),
    ({"prompt": "hi", "max_tokens": 1025}, 400, "max_tokens: must be an int in [1, 1024], got 1025"),
    ({"prompt": ["a"] * 17}, 400, "17 prompts in one request exceed the cap of 16"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "'gpt-9' is not served here"),
    ({"max_tokens": 3}, 400, "prompt: Field required"),
])
def test_completions_bad_input_is_4xx_json(client, body, status, fragment):
    _error(client.post("/v1/completions", json=body), status, fragment)


def test_sweep_needs_the_token(client):
    _error(client.post("/canary/sweep", json={}), 401, "needs a bearer token")
    _error(client.post("/canary/sweep", json={}, headers={"Authorization": "Bearer nope"}), 401, "not the one")
    _error(client.post("/canary/sweep", json={}, headers={"Authorization": TOKEN}), 401, "needs a bearer token")


def test_sweep_clean_verifies_every_cached_slot(client):
    _complete(client, _prompts(3, 2))
    r = client.post("/canary/sweep", json={}, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["cached_slots"] > 0 and out["verified_slots"] == out["cached_slots"] and out["violations"] == []


def test_sweep_finds_a_flipped_idle_cached_slot(client):
    _complete(client, _prompts(3, 3))
    service = client.app.state.service
    with service.lock:
        runs = service.sweep_runs()
        slot = int(runs[0].slots[len(runs[0].slots) // 2])
        flip_bit(service.engine, 0, Half.K, slot, 0, 1)  # inside the fingerprinted first 16 bytes of layer 0 K
    out = client.post("/canary/sweep", json={}, headers=AUTH).json()
    assert [(v["slot"], v["reasons"], v["launch_point"]) for v in out["violations"]] == [
        (slot, ["fingerprint"], "SWEEP")]
    rows = client.get("/canary/violations").json()["violations"]
    assert [(r["id"], r["slot"], r["launch_point"]) for r in rows] == [(0, slot, "SWEEP")]
    assert rows[0]["requests"][0]["request"] == "cache"
    metrics = client.get("/metrics").text
    assert 'kvcanary_violations_total{launch_point="SWEEP",pool="FULL",reason="fingerprint"} 1.0' in metrics
    status = client.get("/canary/status").json()
    assert status["totals"]["by_launch_point"] == {"SWEEP": 1} and status["last_violations"][0]["slot"] == slot
    # the damaged slot left the prefix cache (quarantine): the next sweep finds nothing, nothing serves it
    page = service.engine.config.page_size
    assert f"kvcanary_quarantined_slots_total {float(page)}" in metrics
    with service.lock:
        assert all(slot not in r.slots.tolist() for r in service.sweep_runs())
    assert client.post("/canary/sweep", json={}, headers=AUTH).json()["violations"] == []


def test_slot_route_decodes_the_record_and_owners(client):
    prompt = _prompts(1, 4)[0]
    _complete(client, [prompt], 4)
    service = client.app.state.service
    with service.lock:
        run = service.sweep_runs()[0]
        slot, position, token = int(run.slots[0]), run.start_position, run.token_ids[0]
    out = client.get(f"/canary/slots/{slot}", headers=AUTH).json()
    assert out["stamped"] and out["token"] == token and out["position"] == position and not out["reserved"]
    assert out["chain"].startswith("0x") and len(out["chain"]) == 18
    assert {"prefix_cache": True, "position": position, "locks": 0} in out["owners"]
    zero = client.get("/canary/slots/0").json()
    assert zero["reserved"] and not zero["stamped"]


@pytest.mark.parametrize(("path", "status", "fragment"), [
    ("/canary/slots/512", 404, "outside the pool's slots [0, 512)"),
    ("/canary/slots/-1", 404, "slot -1 is outside"),
    ("/canary/slots/abc", 400, "slot: Input should be a valid integer"),
    ("/canary/violations?since=-1", 400, "since: Input should be greater than or equal to 0"),
    ("/canary/violations?limit=0", 400, "limit: Input should be greater than or equal to 1"),
    ("/canary/nothing", 404, "Not Found"),
])
def test_bad_admin_requests_are_4xx_json(client, path, status, fragment):
    _error(client.get(path), status, fragment)


def test_fault_routes_refused_when_not_enabled():
    with _client(faults=False) as c:
        _error(c.get("/canary/faults", headers=AUTH), 403, "fault injection is disabled")
        _error(c.post("/canary/faults/used_slot_flip", headers=AUTH, json={}), 403, "fault injection is disabled")
        assert c.get("/canary/status").json()["admin"]["faults_enabled"] is False


@pytest.mark.parametrize(("kind", "body", "status", "fragment"), [
    ("used_slot_flip", None, 401, "needs a bearer token"),
    ("no_such_fault", {}, 404, "unknown fault kind 'no_such_fault'"),
    ("used_slot_flip", {"probability": 2.0}, 400, "probability must be in [0, 1]"),
    ("used_slot_flip", {"warmup_steps": -3}, 400, "warmup_steps must be an int >= 0"),
    ("used_slot_flip", {"colour": "red"}, 400, "unknown parameter 'colour'"),
    ("position_skew", {"offset": "x"}, 400, "offset must be int, got 'x'"),
    ("position_skew", {"offset": True}, 400, "offset must be int, got True"),
    ("used_slot_flip", {"probability": "1"}, 400, "probability must be float"),
    ("position_skew", {"request_id": 1.5}, 400, "request_id must be int or None"),
])
def test_fault_injection_bad_requests(client, kind, body, status, fragment):
    headers = AUTH if body is not None else {}
    _error(client.post(f"/canary/faults/{kind}", headers=headers, json=body or {}), status, fragment)


def test_injected_fault_is_reported_at_its_reason_and_launch_point(client):
    _complete(client, _prompts(2, 5))
    assert client.get("/canary/violations").json() == {"violations": [], "next": 0, "dropped": 0}
    r = client.post("/canary/faults/used_slot_flip", headers=AUTH, json={"seed": 7})
    assert r.status_code == 200, r.text
    _complete(client, _prompts(2, 6), 8)
    listing = client.get("/canary/faults", headers=AUTH).json()
    assert "used_slot_flip" in listing["kinds"] and len(listing["injections"]) == 1
    slot = listing["injections"][0]["slot"]
    page = client.get("/canary/violations", params={"limit": 1}).json()
    first = page["violations"][0]
    assert (first["id"], first["slot"], first["reasons"], first["launch_point"]) == (0, slot, ["fingerprint"], "TAIL")
    rest = client.get("/canary/violations", params={"since": page["next"]}).json()
    assert all(v["id"] >= 1 and v["slot"] == slot for v in rest["violations"])


def test_metrics_route_exposes_every_counter(client):
    _complete(client, _prompts(1, 8))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("kvcanary_violations_total", "kvcanary_verified_slots_total", "kvcanary_stamped_slots_total",
                 "kvcanary_sweeps_total", "kvcanary_verify_skipped_total", "kvcanary_recomputed_requests_total"):
        assert f"# TYPE {name} counter" in r.text
    assert 'kvcanary_violations_total{launch_point="HEAD",pool="FULL",reason="chain"} 0.0' in r.text


def test_no_token_configured_lets_sweeps_through():
    with _client(token=None, faults=False) as c:
        assert c.post("/canary/sweep", json={}).status_code == 200
        assert c.get("/canary/status").json()["admin"]["auth"] is False


def test_sweep_with_the_canary_off_is_409():
    with _client(policy=Policy.OFF) as c:
        _error(c.post("/canary/sweep", json={}, headers=AUTH), 409, "the canary is off")


def test_raise_policy_fails_the_reader_with_500_and_keeps_serving():
    with _client(policy=Policy.RAISE) as c:
        _complete(c, _prompts(1, 9))
        assert c.post("/canary/faults/used_slot_flip", headers=AUTH, json={}).status_code == 200
        _error(c.post("/v1/completions", json={"prompt": _prompts(1, 10), "max_tokens": 8}), 500,
               "damaged KV-cache entries (fingerprint at TAIL)", "raise policy")
        status = c.get("/canary/status").json()
        assert status["engine"]["stopped"] is None and status["engine"]["on_violation"] == "fail-requests"
        assert status["last_violations"][0]["reasons"] == ["fingerprint"]
        assert c.get("/health").json() == {"status": "ok"}
        _complete(c, "again", 2)


def test_raise_policy_with_on_violation_stop_stops_the_engine_with_503():
    config = ServeConfig(engine=EngineConfig(num_slots=512, max_ctx=256, chunk_size=32, host_tier_slots=256),
                         canary=CanaryConfig(policy=Policy.RAISE, sweep_interval=4),
                         admin=AdminConfig(token=TOKEN, enable_faults=True), on_violation="stop")
    with TestClient(build_app(config), base_url="http://127.0.0.1:8000") as c:
        _complete(c, _prompts(1, 9))
        assert c.post("/canary/faults/used_slot_flip", headers=AUTH, json={}).status_code == 200
        _error(c.post("/v1/completions", json={"prompt": _prompts(1, 10), "max_tokens": 8}), 503,
               "the engine stopped", "KV-cache violation (fingerprint at TAIL)")
        status = c.get("/canary/status").json()
        assert "KV-cache violation" in status["engine"]["stopped"]
        assert status["last_violations"][0]["reasons"] == ["fingerprint"]
        _error(c.post("/v1/completions", json={"prompt": "again", "max_tokens": 2}), 503, "the engine stopped")


def test_admin_served_alone_on_a_bare_canary():
    canary = Canary(CanaryConfig(), PoolGeometry(64, 4, 32))
    admin = CanaryAdmin(AdminTarget(canary, threading.RLock()), AdminConfig())
    with TestClient(admin_app(admin)) as c:
        assert c.get("/canary/status").json()["totals"]["steps"] == 0
        assert c.post("/canary/sweep", json={}).json()["verified_slots"] == 0
        assert c.get("/canary/slots/3").json()["owners"] is None
        _error(c.get("/canary/slots/64"), 404, "[0, 64)")
        assert "kvcanary_stamped_slots_total 0.0" in c.get("/metrics").text


def test_violation_log_pages_and_counts_dropped_rows():
    from kvcanary.core.record import LaunchTag
    from kvcanary.runtime.reporting import Violation

    log = ViolationLog(3)
    log.add([Violation(s, LaunchTag(LaunchPoint.HEAD), Reason.CHAIN, 10 + s, s, 1, -1, 2, 3) for s in range(5)])
    rows, nxt, dropped = log.since(0, 10)
    assert [r["id"] for r in rows] == [2, 3, 4] and nxt == 5 and dropped == 2
    rows, nxt, dropped = log.since(3, 1)
    assert [r["slot"] for r in rows] == [13] and nxt == 4 and dropped == 0
    assert log.since(5, 10) == ([], 5, 0)


def test_admin_config_validates():
    with pytest.raises(ValueError, match="AdminConfig.token must be a non-empty string"):
        AdminConfig(token=" ")
    with pytest.raises(ValueError, match="AdminConfig.history must be an int >= 1"):
        AdminConfig(history=0)


def test_cached_content_needs_the_token(client):
    """Token ids, chains and fingerprints of a slot, and the stored/expected values of a violation,
    are shown only with the token: scanning the slots must not rebuild another client's prompt."""
    prompt = _prompts(1, 11)[0]
    _complete(client, [prompt], 4)
    service = client.app.state.service
    with service.lock:
        run = service.sweep_runs()[0]
        slot = int(run.slots[len(run.slots) // 2])
        flip_bit(service.engine, 0, Half.K, slot, 0, 1)
    assert client.post("/canary/sweep", json={}, headers=AUTH).json()["violations"]
    open_view = client.get(f"/canary/slots/{slot}").json()
    full = client.get(f"/canary/slots/{slot}", headers=AUTH).json()
    assert (open_view["token"], open_view["chain"], open_view["fingerprint"], open_view["content_shown"]) == (
        None, None, None, False)
    assert full["token"] == run.token_ids[len(run.slots) // 2] and full["chain"].startswith("0x")
    assert full["content_shown"]
    assert open_view["position"] == full["position"] and open_view["stamped"]
    for path in ("/canary/violations", "/canary/status"):
        key = "violations" if path.endswith("violations") else "last_violations"
        hidden, shown = client.get(path).json()[key][0], client.get(path, headers=AUTH).json()[key][0]
        assert [hidden[k] for k in ("token", "expected_token", "stored_value", "expected_value")] == [None] * 4
        assert shown["token"] is not None and shown["stored_value"] is not None
        assert hidden["slot"] == shown["slot"] == slot
    wrong = client.get(f"/canary/slots/{slot}", headers={"Authorization": "Bearer nope"}).json()
    assert wrong["token"] is None


def test_sweep_counters_agree_everywhere(caplog):
    """/metrics, /canary/status and the stats line count the same sweeps (load-back checks, which
    also launch at SWEEP, are not sweeps), after enough traffic to evict and load back."""
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    config = ServeConfig(engine=EngineConfig(num_slots=96, max_ctx=64, chunk_size=16, host_tier_slots=256),
                         canary=CanaryConfig(sweep_interval=2, stats_period=1))
    with caplog.at_level(logging.INFO, logger="kvcanary"), \
            TestClient(build_app(config), base_url="http://127.0.0.1") as c:
        for seed in (20, 21, 22, 20, 21):  # later rounds evict earlier ones to the host tier; repeats load back
            _complete(c, _prompts(3, seed), 6)
        status = c.get("/canary/status").json()
        metrics = {s.name: s.value for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples}
        stats = c.app.state.service.engine.stats
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary stats:")]
    from kvcanary.runtime.reporting import STATS_RE

    last = STATS_RE.match(lines[-1])
    assert stats.num_loaded_slots > 0, "the workload must load slots back for the counts to differ"
    assert status["counters"]["SWEEP"]["launches"] > status["totals"]["sweeps"] > 0
    assert int(last["sweeps"]) == status["totals"]["sweeps"] == metrics["kvcanary_sweeps_total"]
