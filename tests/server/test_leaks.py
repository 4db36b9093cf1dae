"""Nothing a caller without the admin token can reach shows cached content: after a fault under
each policy (log, raise, recompute, raise with on_violation 'stop'), every body and header of
/health, /metrics, the admin routes without the token, the failed request's own error and a
later request's answer is scanned for the prompts' token ids, the prompt's text, the chain and
fingerprint values of the damaged slots, and engine and other clients' request ids."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.server.admin import AdminConfig
from kvcanary.server.app import build_app
from kvcanary.server.config import OnViolation, ServeConfig

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VOCAB = 20_000
SECRET_TEXT = "Zanzibar quokka 4471 ledger"
SECRET_IDS = [10_007 + 211 * i for i in range(40)]  # five-digit ids no counter or timing takes
FIRST_ENGINE_ID = 7_340_033  # engine ids no other number in the answers takes
CLIENT_ID = "victim-rid-5521"
MODES = {"log": (Policy.LOG, OnViolation.FAIL_REQUESTS), "raise": (Policy.RAISE, OnViolation.FAIL_REQUESTS),
         "recompute": (Policy.RECOMPUTE, OnViolation.FAIL_REQUESTS), "stop": (Policy.RAISE, OnViolation.STOP)}


def _number(n: int) -> re.Pattern:
    return re.compile(rf"(?<![\d.]){n}(?![\d.])")


class Secrets:
    def __init__(self):
        self.strings = {SECRET_TEXT, "quokka", CLIENT_ID}
        self.numbers = {*SECRET_IDS, *range(FIRST_ENGINE_ID, FIRST_ENGINE_ID + 50)}

    def add_value(self, value) -> None:
        """A chain, fingerprint or stored/expected 64-bit value: every form it could take."""
        if value is None:
            return
        v = int(value, 16) if isinstance(value, str) else int(value)
        if abs(v) < 1 << 20:
            return  # a position or a small token: not distinctive
        u = v & (2**64 - 1)
        self.strings |= {f"{u:016x}", f"{u:x}", f"{u:X}"}
        self.numbers |= {u, u - (1 << 64) if u >= 1 << 63 else u}

    def found(self, text: str) -> list[str]:
        hits = [s for s in self.strings if s.lower() in text.lower()]
        hits += [str(n) for n in self.numbers if _number(n).search(text)]
        return hits


def _client(policy: Policy, on_violation: OnViolation) -> TestClient:
    config = ServeConfig(model=ModelConfig(vocab_size=VOCAB),
                         engine=EngineConfig(num_slots=512, max_ctx=256, chunk_size=32, host_tier_slots=256),
                         canary=CanaryConfig(policy=policy, sweep_interval=4),
                         admin=AdminConfig(token=TOKEN, enable_faults=True), on_violation=on_violation)
    return TestClient(build_app(config), base_url="http://127.0.0.1:8000", raise_server_exceptions=False)


def _prompts() -> list[list[int]]:
    return [SECRET_IDS, list(SECRET_TEXT.encode())]


@pytest.mark.parametrize("mode", list(MODES))
def test_nothing_cached_reaches_a_caller_without_the_token(mode):
    policy, on_violation = MODES[mode]
    with _client(policy, on_violation) as c:
        service = c.app.state.service
        service._next_id = FIRST_ENGINE_ID
        assert c.post("/canary/faults/used_slot_flip", headers=AUTH, json={"seed": 1, "warmup_steps": 2}).status_code \
            == 200
        victim = c.post("/v1/completions", json={"prompt": _prompts(), "max_tokens": 24},
                        headers={"X-Request-Id": CLIENT_ID})
        streamed = c.post("/v1/completions", json={"prompt": SECRET_TEXT, "max_tokens": 8, "stream": True})
        later = c.post("/v1/completions", json={"prompt": "a later request", "max_tokens": 4})
        # what the token shows: the test can fail only if the fault was found and its values are known
        rows = c.get("/canary/violations", headers=AUTH).json()["violations"]
        assert rows, "the fault must have been detected"
        secrets = Secrets()
        for r in rows:
            for key in ("stored_value", "expected_value"):
                secrets.add_value(r[key])
            full = c.get(f"/canary/slots/{r['slot']}", headers=AUTH).json()
            secrets.add_value(full["chain"])
            secrets.add_value(full["fingerprint"])
        assert any(isinstance(o["request"], int) and o["request"] >= FIRST_ENGINE_ID for r in rows
                   for o in r["requests"]), "the token's view names the engine requests"
        expected = {"log": 200, "recompute": 200, "raise": 500, "stop": 503}[mode]
        assert victim.status_code == expected, victim.text
        answers = {"victim": victim, "streamed": streamed, "later": later} if expected != 200 else {}
        if expected == 200 and streamed.status_code != 200:
            answers["streamed"] = streamed
        for path in ("/health", "/metrics", "/canary/status", "/canary/violations", "/canary/incidents",
                     "/canary/faults", "/canary/nothing", *(f"/canary/slots/{r['slot']}" for r in rows)):
            answers[f"GET {path}"] = c.get(path)
        for path in ("/canary/sweep", "/canary/faults/used_slot_flip"):
            answers[f"POST {path}"] = c.post(path, json={})
        answers["wrong token"] = c.get("/canary/status", headers={"Authorization": "Bearer nope"})
        leaks = {}
        for name, r in answers.items():
            text = r.text + "\n" + "\n".join(f"{k}: {v}" for k, v in r.headers.items())
            hits = [h for h in secrets.found(text) if not (name == "victim" and h == CLIENT_ID)]  # its own id
            if hits:
                leaks[name] = hits
        assert leaks == {}
        status = c.get("/canary/status").json()
        assert status["last_violations"] and all(o["request"] in (None, "cache")
                                                 for v in status["last_violations"] for o in v["requests"])
        if mode == "stop":
            assert json.loads(answers["GET /health"].text)["status"] == "stopped"
