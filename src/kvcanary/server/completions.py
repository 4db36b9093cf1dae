"""OpenAI-compatible ``/v1/completions`` (and ``/v1/models``) over an ``EngineService``.

Prompts are text (byte-level tokens, see ``ByteTokenizer``), a list of texts, a list of token
ids or a list of such lists, as the OpenAI API allows; each becomes one choice. ``max_tokens``
(default 16) tokens are generated per prompt (the reference model has no end-of-sequence token,
so ``finish_reason`` is ``length``). Sampling options are accepted and ignored (the engine samples
greedily); ``n`` must be 1 and ``stream`` false.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict

from kvcanary.errors import CapacityError
from kvcanary.server.service import EngineService, EngineStopped
from kvcanary.server.tokenizer import ByteTokenizer


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # temperature, top_p, ...: accepted, ignored

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    n: int = 1
    stream: bool = False
    echo: bool = False


def _bad(message: str, status: int = 400) -> HTTPException:
    return HTTPException(status, message)


def completions_router(service: EngineService) -> APIRouter:
    r = APIRouter()
    name = service.config.model_name
    vocab = service.config.model.vocab_size
    tokenizer = ByteTokenizer(vocab) if vocab >= 256 else None

    def to_ids(prompt: str | list) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise _bad(f"prompt: the model's vocabulary ({vocab}) is too small for byte-level text; "
                           "send token ids")
            return tokenizer.encode(prompt)
        return list(prompt)

    @r.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kv-canary"}]}

    @r.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict:
        if req.model not in (None, name):
            raise _bad(f"model {req.model!r} is not served here; this server serves {name!r}", 404)
        if req.stream:
            raise _bad("stream: streaming is not supported by the reference server; pass stream=false")
        if req.n != 1:
            raise _bad(f"n: only n=1 is supported, got {req.n}")
        if req.max_tokens is None or req.max_tokens < 1:
            raise _bad(f"max_tokens: must be an int >= 1, got {req.max_tokens!r}")
        prompts = [req.prompt] if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) \
            else list(req.prompt)
        if not prompts:
            raise _bad("prompt: must not be empty")
        ids = [to_ids(p) for p in prompts]
        for i, p in enumerate(ids):
            if not p or not all(0 <= t < vocab for t in p):
                raise _bad(f"prompt[{i}]: must be non-empty with token ids in [0, {vocab}), got {str(p[:8])[:60]}")
        try:
            outputs = service.generate(ids, req.max_tokens)
        except (ValueError, CapacityError) as e:
            raise _bad(f"prompt: {e}") from None
        except EngineStopped as e:
            raise _bad(str(e), 503) from None
        except TimeoutError as e:
            raise _bad(str(e), 504) from None
        choices = []
        for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
            text = tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))
            if req.echo and isinstance(p, str):
                text = p + text
            choices.append({"text": text, "index": i, "logprobs": None,
                            "finish_reason": "length" if len(out) >= req.max_tokens else "stop",
                            "token_ids": out})
        prompt_tokens, completion_tokens = sum(map(len, ids)), sum(map(len, outputs))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    return r
