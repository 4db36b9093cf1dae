"""Sampling parameters through the OpenAI-compatible routes: temperature 0 is greedy, a seed
reproduces a sampled answer (streamed or not, and after a recompute), another seed changes it,
stop strings end the text and are left out (finish_reason "stop"), max_tokens ends it with
"length"; what the server cannot honour, and fields it does not know, are refused with 400
naming the parameter."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig
from kvcanary.server.admin import AdminConfig
from kvcanary.server.app import build_app
from kvcanary.server.service import ServeConfig

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "Once upon a time the canary"


def _client(policy: Policy = Policy.LOG) -> TestClient:
    config = ServeConfig(engine=EngineConfig(num_slots=512, max_ctx=256, chunk_size=32, host_tier_slots=256),
                         canary=CanaryConfig(policy=policy, sweep_interval=4),
                         admin=AdminConfig(token=TOKEN, enable_faults=True))
    return TestClient(build_app(config), base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def client():
    with _client() as c:
        yield c


def _choice(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(client, **body) -> tuple[str, str]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("error" not in e for e in events), events
    return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]


def test_temperature_zero_is_greedy_and_a_seed_reproduces_a_sampled_answer(client):
    greedy = _choice(client)
    assert _choice(client, temperature=0)["token_ids"] == greedy["token_ids"]
    assert _choice(client, temperature=0.7, top_k=1, seed=5)["token_ids"] == greedy["token_ids"]
    a = _choice(client, temperature=1.0, top_p=0.9, seed=1234)
    assert a["finish_reason"] == "length" and len(a["token_ids"]) == 24
    assert a["token_ids"] != greedy["token_ids"]
    assert _choice(client, temperature=1.0, top_p=0.9, seed=1234)["token_ids"] == a["token_ids"]
    assert _streamed(client, temperature=1.0, top_p=0.9, seed=1234) == (a["text"], "length")
    assert _choice(client, temperature=1.0, top_p=0.9, seed=1235)["token_ids"] != a["token_ids"]
    assert _choice(client, temperature=1.0, top_p=0.9, seed=-1)["token_ids"] == \
        _choice(client, temperature=1.0, top_p=0.9, seed=(1 << 64) - 1)["token_ids"]  # int64 seeds wrap
    unseeded = [_choice(client, temperature=1.0)["token_ids"] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_stop_strings_end_the_text_and_are_left_out(client):
    full = _choice(client, max_tokens=40)
    text = full["text"]
    stop = text[12:15]
    cut = text.find(stop)
    got = _choice(client, max_tokens=40, stop=[stop, "\x00never"])
    assert (got["text"], got["finish_reason"]) == (text[:cut], "stop")
    assert stop not in got["text"]
    ids = got["token_ids"]
    assert ids == full["token_ids"][: len(ids)] and cut + len(stop) <= len(ids) < len(full["token_ids"])
    assert _streamed(client, max_tokens=40, stop=stop) == (text[:cut], "stop")
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 40}).json()
    content = chat["choices"][0]["message"]["content"]
    stop = content[5:7]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 40, "stop": stop}).json()
    assert chat["choices"][0]["message"]["content"] == content[: content.find(stop)]
    assert chat["choices"][0]["finish_reason"] == "stop"
    service = client.app.state.service
    assert service.engine.requests == {} and not service.live  # a stopped request left the engine
    assert 'kvcanary_request_success_total{finished_reason="stop"} 3.0' in client.get("/metrics").text


def test_recompute_delivers_the_seeded_answer_of_a_fault_free_run(client):
    body = {"temperature": 1.0, "seed": 99, "max_tokens": 48}
    want = _choice(client, **body)["token_ids"]
    with _client(Policy.RECOMPUTE) as c:
        assert c.post("/canary/faults/used_slot_flip", headers=AUTH, json={"warmup_steps": 3}).status_code == 200
        got = _choice(c, **body)
        status = c.get("/canary/status", headers=AUTH).json()
    assert status["totals"]["violations"] >= 1 and status["totals"]["recomputed_requests"] >= 1
    assert got["token_ids"] == want


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"logprobs": 2}, "logprobs", "logprobs: not supported by this server (got 2)"),
    ({"n": 2}, "n", "only n=1 is supported"),
    ({"best_of": 3}, "best_of", "best_of: not supported"),
    ({"logit_bias": {"50": 10}}, "logit_bias", "logit_bias: not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty: not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "frequency_penalty: not supported"),
    ({"suffix": "tail"}, "suffix", "suffix: not supported"),
    ({"colour": "red"}, "colour", "colour: unknown field"),
    ({"temperature": 2.5}, "temperature", "temperature: must be a number in [0, 2], got 2.5"),
    ({"top_p": 0}, "top_p", "top_p: must be a number in (0, 1], got 0"),
    ({"top_k": -2}, "top_k", "top_k: must be an int >= -1"),
    ({"seed": 1 << 64}, "seed", "seed: must be an int in [-2^63, 2^64)"),
    ({"stop": ""}, "stop", "stop: at most 16 non-empty strings"),
    ({"stop": ["a"] * 17}, "stop", "stop: at most 16 non-empty strings"),
    ({"temperature": "hot"}, "temperature", "temperature"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(client, body, param, fragment):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"service_tier": "auto"}, "service_tier"),
])
def test_chat_refuses_what_it_cannot_honour(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "mood": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].mood", r.text


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    greedy = _choice(client)["token_ids"]
    neutral = {"logprobs": None, "best_of": 1, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
               "user": "someone", "top_k": -1, "top_p": 1.0, "stop": None}
    assert _choice(client, **neutral)["token_ids"] == greedy
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "name": "ann"}],
                                                      "max_tokens": 2, "logprobs": False, "top_logprobs": 0})
    assert chat.status_code == 200, chat.text
