"""OpenAI-compatible routes over an ``EngineService``: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health``.

Prompts are text (byte-level tokens, see ``ByteTokenizer``), a list of texts, a list of token
ids or a list of such lists, as the OpenAI API allows; each becomes one choice. Chat messages
go through ``chat_prompt``. At most ``max_tokens`` (default 16) tokens are generated per prompt;
the reference model has no end-of-sequence token, so ``finish_reason`` is ``length`` unless one
of the ``stop`` strings appeared (``stop``: the text ends before it and leaves it out; the token
ids run to the token that completed it). ``temperature`` (default 0: greedy, the reference
model's own default), ``top_p``, ``top_k`` (0 or -1: every token) and ``seed`` (the same seed
and request give the same tokens) pick the tokens (``SamplingParams``). Parameters the server
cannot honour (``logprobs``, ``n`` > 1, ``best_of`` > 1, ``logit_bias``, penalties, tools, ...)
are refused with 400 naming the parameter unless they hold their neutral value, and so are
fields it does not know. ``stream`` answers Server-Sent Events (``data: {chunk}`` lines, then
``data: [DONE]``); an error after the stream started arrives as ``data: {"error": ...}`` before
``[DONE]``.

Every route awaits; none holds a thread while its generation runs. A client that disconnects,
or a request past ``ServeLimits.request_timeout_s`` (504), is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvcanary.engine.sampler import SamplingParams
from kvcanary.server.errors import ApiError, AsciiJSONResponse, error_body
from kvcanary.server.service import EngineService, Generation
from kvcanary.server.tokenizer import ByteTokenizer, TextOutput, chat_prompt


class StreamOptions(BaseModel):
    include_usage: bool = False


_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # OpenAI's int64 seeds and the engine's uint64 ones
MAX_STOPS = 16


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field it does not know is refused, never ignored

    model: str | None = None
    max_tokens: int | None = 16
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None  # an end-user id for the client's own records: accepted, unused
    # what it cannot honour: refused unless at its neutral value (``UNSUPPORTED``)
    logprobs: Any = None
    top_logprobs: Any = None
    best_of: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: Any = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # a participant's name: accepted, not part of the template


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


def _is_neutral(name: str, value) -> bool:
    """Whether an unsupported parameter holds the value that asks for nothing."""
    if value is None:
        return True
    if name == "logprobs":
        return value is False
    if name in ("top_logprobs", "best_of"):
        return type(value) is int and value == (0 if name == "top_logprobs" else 1)
    if name == "logit_bias":
        return value == {}
    if name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        return type(value) in (int, float) and value == (1 if name == "repetition_penalty" else 0)
    return False


UNSUPPORTED = ("logprobs", "top_logprobs", "best_of", "logit_bias", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "suffix", "tools", "tool_choice", "parallel_tool_calls", "functions",
               "function_call", "response_format")


def check_supported(req: _Sampling) -> None:
    """400 naming the first parameter of ``UNSUPPORTED`` that asks for something."""
    for param in UNSUPPORTED:
        value = getattr(req, param, None)
        if not _is_neutral(param, value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ApiError(400, f"{param}: not supported by this server (got {shown}); leave it out", param)


def sampling_params(req: _Sampling) -> SamplingParams | None:
    """The request's ``SamplingParams`` (None: greedy), each value checked against its range."""
    t, p, k, seed = req.temperature, req.top_p, req.top_k, req.seed
    if t is not None and not 0 <= t <= 2:
        raise ApiError(400, f"temperature: must be a number in [0, 2], got {t!r}", "temperature")
    if p is not None and not 0 < p <= 1:
        raise ApiError(400, f"top_p: must be a number in (0, 1], got {p!r}", "top_p")
    if k is not None and k < -1:
        raise ApiError(400, f"top_k: must be an int >= -1 (-1 or 0: every token), got {k!r}", "top_k")
    if seed is not None and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise ApiError(400, f"seed: must be an int in [-2^63, 2^64), got {seed!r}", "seed")
    if not t:
        return None
    return SamplingParams(temperature=t, top_p=1.0 if p is None else p, top_k=max(k or 0, 0),
                          seed=None if seed is None else seed % (1 << 64))


def stop_strings(req: _Sampling, has_text: bool, vocab: int) -> tuple[str, ...]:
    """The request's stop strings; refused (400) beyond ``MAX_STOPS``, empty, or without text."""
    if req.stop is None:
        return ()
    out = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if len(out) > MAX_STOPS or not all(out):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings, got {str(list(out))[:80]}", "stop")
    if out and not has_text:
        raise ApiError(400, f"stop: the model's vocabulary ({vocab}) is too small for byte-level text", "stop")
    return out


def _encode(tokenizer: ByteTokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: contains a lone surrogate (U+{ord(text[e.start]):04X}) at character "
                            f"{e.start}; send valid UTF-8 text", param) from None


def request_id(request: Request) -> str:
    """The client's ``X-Request-Id`` (checked by the app's middleware) or a fresh one."""
    return request.scope.get("state", {}).get("request_id") or f"cmpl-{uuid.uuid4().hex}"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Waiter:
    """Waits for the next change of a request's generations, its deadline or its client leaving."""

    def __init__(self, request: Request, gens: Sequence[Generation], timeout_s: float):
        self.gens, self.timeout_s = gens, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.gone = asyncio.ensure_future(_disconnected(request))

    async def next(self) -> None:
        """Return after a change; raise ApiError 504 at the deadline and 499 when the client left."""
        changed = self.gens[0].changed
        if not changed.is_set():
            wait = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait({wait, self.gone}, timeout=max(self.deadline - time.monotonic(), 0),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                wait.cancel()
            if self.gone.done():
                raise ApiError(499, "the client closed the connection; the request was aborted")
            if not changed.is_set():
                raise ApiError(504, f"the request did not finish within {self.timeout_s:g} s "
                                    "(ServeLimits.request_timeout_s); it was aborted")
        changed.clear()

    def close(self) -> None:
        self.gone.cancel()


class _Prepared:
    def __init__(self, ids: list[list[int]], max_tokens: int, texts: list[str | None],
                 sampling: SamplingParams | None, stops: tuple[str, ...]):
        self.ids, self.max_tokens, self.texts = ids, max_tokens, texts
        self.sampling, self.stops = sampling, stops


class _Completions:
    """The OpenAI-compatible routes over one ``EngineService`` (its model name, vocabulary and
    limits read once)."""

    def __init__(self, service: EngineService):
        self.service = service
        self.name = service.config.model_name
        self.vocab = service.config.model.vocab_size
        self.limits = service.limits
        self.tokenizer = ByteTokenizer(self.vocab) if self.vocab >= 256 else None

    def text_of(self, gen: Generation) -> str:
        return gen.text.text if gen.text is not None else " ".join(map(str, gen.tokens))

    def check_common(self, req: _Sampling, max_tokens: int | None, tokens_param: str) -> int:
        if req.model not in (None, self.name):
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {self.name!r}", "model")
        if req.n != 1:
            raise ApiError(400, f"n: only n=1 is supported, got {req.n}", "n")
        check_supported(req)
        if max_tokens is None or max_tokens < 1 or max_tokens > self.limits.max_tokens:
            raise ApiError(400, f"{tokens_param}: must be an int in [1, {self.limits.max_tokens}], got {max_tokens!r}",
                           tokens_param)
        return max_tokens

    def check_ids(self, ids: list[list[int]]) -> None:
        for i, p in enumerate(ids):
            if not p or not all(0 <= t < self.vocab for t in p):
                raise ApiError(400, f"prompt[{i}]: must be non-empty with token ids in [0, {self.vocab}), got "
                                    f"{str(p[:8])[:60]}", "prompt")

    def prepare_completion(self, req: CompletionRequest) -> _Prepared:
        max_tokens = self.check_common(req, req.max_tokens, "max_tokens")
        single = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
        prompts = [req.prompt] if single else list(req.prompt)
        if not prompts:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if len(prompts) > self.limits.max_prompts:
            raise ApiError(400, f"prompt: {len(prompts)} prompts in one request exceed the cap of "
                                f"{self.limits.max_prompts} (ServeLimits.max_prompts); split the request", "prompt")
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ApiError(400, f"prompt: the model's vocabulary ({self.vocab}) is too small for byte-level "
                                        "text; send token ids", "prompt")
                ids.append(_encode(self.tokenizer, p, "prompt"))
            else:
                ids.append(list(p))
        self.check_ids(ids)
        return _Prepared(ids, max_tokens, [p if isinstance(p, str) and req.echo else None for p in prompts],
                         sampling_params(req), stop_strings(req, self.tokenizer is not None, self.vocab))

    def prepare_chat(self, req: ChatRequest) -> _Prepared:
        max_tokens = self.check_common(req, req.max_completion_tokens or req.max_tokens, "max_tokens")
        if not req.messages:
            raise ApiError(400, "messages: must not be empty", "messages")
        if self.tokenizer is None:
            raise ApiError(400, f"messages: the model's vocabulary ({self.vocab}) is too small for byte-level text",
                           "messages")
        turns = [(m.role, m.content if isinstance(m.content, str) else "".join(p.text for p in m.content))
                 for m in req.messages]
        ids = [_encode(self.tokenizer, chat_prompt(turns), "messages")]
        self.check_ids(ids)
        stops = stop_strings(req, self.tokenizer is not None, self.vocab)
        return _Prepared(ids, max_tokens, [None], sampling_params(req), stops)

    async def generate(self, request: Request, req: _Sampling, prep: _Prepared, cid: str, chunk) -> object:
        """The finished generations, or with ``req.stream`` the SSE response of ``chunk`` events."""
        client_ids = [cid] if len(prep.ids) == 1 else [f"{cid}.{i}" for i in range(len(prep.ids))]
        texts = [TextOutput(self.tokenizer, prep.stops) for _ in prep.ids] if self.tokenizer is not None else None
        gens = await self.service.submit(prep.ids, prep.max_tokens, client_ids, stream=req.stream,
                                    sampling=prep.sampling, texts=texts)
        waiter = _Waiter(request, gens, self.limits.request_timeout_s)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self.stream_chunks(gens, waiter, chunk, prep, include_usage)
            return _EventStream(events, lambda: self._end(gens, waiter))
        try:
            while not all(g.is_done for g in gens):
                await waiter.next()
        except ApiError as e:
            self._end(gens, waiter, e)
            raise
        except BaseException:  # cancelled (shutdown): the engine must not keep generating
            self._end(gens, waiter)
            raise
        waiter.close()
        for g in gens:
            if g.error is not None:
                raise g.error
        return gens

    def _end(self, gens, waiter: _Waiter, error: ApiError | None = None) -> None:
        waiter.close()
        self.service.abort(gens, error or ApiError(499, "the client closed the connection; the request was aborted"))

    def usage(self, prep: _Prepared, gens: Sequence[Generation]) -> dict:
        prompt_tokens, completion_tokens = sum(map(len, prep.ids)), sum(len(g.tokens) for g in gens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @staticmethod
    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj, ensure_ascii=True)}\n\n".encode()

    async def stream_chunks(self, gens, waiter: _Waiter, chunk, prep: _Prepared, include_usage: bool):
        """SSE bytes of ``gens``: ``chunk(index, text, finish_reason)`` builds each event. Text
        goes out as far as its ``TextOutput`` lets it (a possible stop string is held back)."""
        seen, ended = [0] * len(gens), [False] * len(gens)
        for i, text in enumerate(prep.texts):
            if text:
                yield self.sse(chunk(i, text, None))
        try:
            while True:
                for i, g in enumerate(gens):
                    if ended[i]:
                        continue
                    finish = g.finish_reason  # read first: once set, the text is whole
                    if g.text is not None:
                        text, ready = g.text.view
                        piece, seen[i] = text[seen[i]:ready], max(seen[i], ready)
                    else:
                        new, seen[i] = g.tokens[seen[i]:], len(g.tokens)
                        piece = " ".join(map(str, new)) + " " if new else ""
                    if piece:
                        yield self.sse(chunk(i, piece, None))
                    if g.error is not None:
                        yield self.sse(error_body(g.error.status, g.error.message, g.error.param))
                        yield b"data: [DONE]\n\n"
                        return
                    if finish is not None:
                        ended[i] = True
                        yield self.sse(chunk(i, "", finish))
                if all(ended):
                    break
                await waiter.next()
        except ApiError as e:
            yield self.sse(error_body(e.status, e.message, e.param))
            yield b"data: [DONE]\n\n"
            return
        if include_usage:
            yield self.sse({**chunk(0, "", None), "choices": [], "usage": self.usage(prep, gens)})
        yield b"data: [DONE]\n\n"

    async def health(self):
        if self.service.error is not None:
            return AsciiJSONResponse({"status": "stopped", "error": self.service.error}, 503)
        if self.service.draining:
            return AsciiJSONResponse({"status": "draining"}, 503)
        return {"status": "ok"}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "kv-canary",
                                            "max_model_len": self.service.config.engine.max_ctx}]}

    async def completions(self, req: CompletionRequest, request: Request):
        prep = self.prepare_completion(req)
        cid, created = request_id(request), int(time.time())

        def chunk(i, text, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": self.name,
                    "choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}]}

        out = await self.generate(request, req, prep, cid, chunk)
        if req.stream:
            return out
        choices = [{"text": (prep.texts[i] or "") + self.text_of(g), "index": i, "logprobs": None,
                    "finish_reason": g.finish_reason, "token_ids": g.tokens} for i, g in enumerate(out)]
        return {"id": cid, "object": "text_completion", "created": created, "model": self.name, "choices": choices,
                "usage": self.usage(prep, out)}

    async def chat(self, req: ChatRequest, request: Request):
        prep = self.prepare_chat(req)
        cid, created = request_id(request), int(time.time())
        first = [True]

        def chunk(i, text, finish):
            delta = {"content": text} if text or finish is None else {}
            if first[0]:
                delta, first[0] = {"role": "assistant", **delta}, False
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.name,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        out = await self.generate(request, req, prep, cid, chunk)
        if req.stream:
            return out
        g = out[0]
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text_of(g)},
                             "logprobs": None, "finish_reason": g.finish_reason}],
                "usage": self.usage(prep, out)}


def completions_router(service: EngineService) -> APIRouter:
    routes, r = _Completions(service), APIRouter()
    r.get("/health")(routes.health)
    r.get("/v1/models")(routes.models)
    r.post("/v1/completions")(routes.completions)
    r.post("/v1/chat/completions")(routes.chat)
    return r


class _EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (finished, client gone, cancelled),
    so an abandoned stream's requests are aborted in the engine."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
