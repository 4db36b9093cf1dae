"""A corpus of malformed and hostile requests against the served engine over real HTTP: every
one is answered with a 4xx and an OpenAI-shaped JSON error (never a 5xx, never a traceback), and
the engine still serves afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.server.conftest import AUTH

J = {"Content-Type": "application/json"}
C, CHAT, FAULT = "/v1/completions", "/v1/chat/completions", "/canary/faults/position_skew"


def _body(obj) -> bytes:
    return json.dumps(obj).encode()


CORPUS = [  # (method, path, headers, body, expected status, param)
    ("POST", C, J, b"", 400, None),
    ("POST", C, J, b"null", 400, None),
    ("POST", C, J, b"[]", 400, None),
    ("POST", C, J, b"123", 400, None),
    ("POST", C, J, b'"text"', 400, None),
    ("POST", C, J, b"{bad", 400, None),
    ("POST", C, J, b"\xff\xfe{}", 400, None),
    ("POST", C, J, b"[" * 100_000, 400, None),
    ("POST", C, J, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("POST", C, J, _body({"prompt": None}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": 5}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": [[]]}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": [-1]}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": [1.5]}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": [2**70]}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": ["a", 1]}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": ["a"] * 2000}), 400, "prompt"),
    ("POST", C, J, _body({"prompt": "x" * 2000}), 400, "prompt"),
    ("POST", C, J, b'{"prompt": "\\ud800 lone"}', 400, "prompt"),
    ("POST", C, J, b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    ("POST", C, J, b'{"prompt": "x", "model": "\\ud800"}', 404, "model"),
    ("POST", C, J, _body({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    ("POST", C, J, _body({"prompt": "x", "max_tokens": 10**30}), 400, "max_tokens"),
    ("POST", C, J, _body({"prompt": "x", "max_tokens": "5x"}), 400, "max_tokens"),
    ("POST", C, J, b'{"prompt": "x", "max_tokens": NaN}', 400, "max_tokens"),
    ("POST", C, J, _body({"prompt": "x", "n": 0}), 400, "n"),
    ("POST", C, J, _body({"prompt": "x", "stream": "often"}), 400, "stream"),
    ("POST", C, J, _body({"prompt": "x", "stream_options": 5}), 400, "stream_options"),
    ("POST", C, J, _body({"prompt": "x" * (2 << 20)}), 413, None),
    ("POST", C, {"Content-Type": "text/plain"}, _body({"prompt": "x"}), 415, "Content-Type"),
    ("POST", C, {"Content-Type": "application/x-www-form-urlencoded"}, b"prompt=x", 415, "Content-Type"),
    ("POST", C, {}, _body({"prompt": "x"}), 415, "Content-Type"),
    ("POST", C, {**J, "X-Request-Id": "x" * 65}, _body({"prompt": "x"}), 400, "X-Request-Id"),
    ("POST", C, {**J, "X-Request-Id": "a;b"}, _body({"prompt": "x"}), 400, "X-Request-Id"),
    ("POST", C, {**J, "Host": "attacker.example"}, _body({"prompt": "x"}), 400, "Host"),
    ("GET", C, {}, b"", 405, None),
    ("POST", CHAT, J, _body({"messages": "hi"}), 400, "messages"),
    ("POST", CHAT, J, _body({"messages": []}), 400, "messages"),
    ("POST", CHAT, J, _body({"messages": [{}]}), 400, "messages[0].role"),
    ("POST", CHAT, J, _body({"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role"),
    ("POST", CHAT, J, _body({"messages": [{"role": "user", "content": None}]}), 400, "messages[0].content"),
    ("POST", CHAT, J, _body({"messages": [{"role": "user", "content": [{"type": "image"}]}]}), 400,
     "messages[0].content"),
    ("POST", CHAT, J, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ("GET", "/canary/slots/99999999999999999999999", {}, b"", 404, "slot"),
    ("GET", "/canary/slots/-5", {}, b"", 404, "slot"),
    ("GET", "/canary/slots/1e3", {}, b"", 400, "slot"),
    ("GET", "/canary/violations?since=abc", {}, b"", 400, "since"),
    ("GET", "/canary/violations?limit=100000000000000000000000000", {}, b"", 400, "limit"),
    ("POST", "/canary/sweep", {}, b"", 415, "Content-Type"),
    ("POST", "/canary/sweep", J, b"", 401, "Authorization"),
    ("POST", "/canary/sweep", {**J, "Authorization": "Bearer"}, b"", 401, "Authorization"),
    ("POST", "/canary/sweep", {**J, "Authorization": b"Bearer \xff\xfe"}, b"", 401, "Authorization"),
    ("PUT", "/canary/sweep", J, b"{}", 405, None),
    ("POST", FAULT, {**J, **AUTH}, b"[1]", 400, None),
    ("POST", FAULT, {**J, **AUTH}, b'"x"', 400, None),
    ("POST", FAULT, {**J, **AUTH}, _body({"offset": "x"}), 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, _body({"offset": 0}), 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, b'{"seed": 1e400}', 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, b'{"probability": NaN}', 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, _body({"max_injections": -1}), 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, _body({"warmup_steps": -1}), 400, "body"),
    ("POST", FAULT, {**J, **AUTH}, _body({"warmup_steps": None}), 400, "body"),
    ("POST", "/canary/faults/%00", {**J, **AUTH}, b"{}", 404, "kind"),
    ("POST", FAULT, J, b"{}", 401, "Authorization"),
    ("GET", "/nothing/here", {}, b"", 404, None),
    ("GET", "/" + "a" * 8000, {}, b"", 404, None),
    ("DELETE", "/metrics", {}, b"", 415, "Content-Type"),
]


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "param"), CORPUS,
                         ids=[f"{i}-{c[0]}-{c[1][:30]}" for i, c in enumerate(CORPUS)])
def test_malformed_request_is_a_clean_4xx(server, method, path, headers, body, status, param):
    base, _ = server
    r = httpx.request(method, f"{base}{path}", headers=headers, content=body, timeout=30)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and err["message"] and "Traceback" not in r.text
    assert err["type"] != "server_error"


def test_still_serving_after_the_corpus(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "still here", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4


def test_catch_all_500_is_json_without_a_traceback():
    """An unexpected failure inside a route is a JSON 500 naming only the exception type."""
    from fastapi.testclient import TestClient
    from tests.server.conftest import serve_config

    from kvcanary.server.app import build_app

    app = build_app(serve_config())

    def broken() -> list:
        raise RuntimeError("secret internals")

    app.state.service.fault_kinds = broken
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
        r = c.get("/canary/faults", headers=AUTH)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in r.json()["error"]["message"] and "secret" not in r.text and "Traceback" not in r.text
