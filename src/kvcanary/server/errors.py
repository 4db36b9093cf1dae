"""OpenAI-shaped errors for every route: ``{"error": {"message", "type", "param", "code"}}``.

| status | type                   | when                                                         |
|--------|------------------------|--------------------------------------------------------------|
| 400    | invalid_request_error  | validation (``param`` names the field), bad Host, bad JSON   |
| 401    | authentication_error   | missing or wrong bearer token                                 |
| 403    | permission_error       | fault injection disabled                                      |
| 404    | not_found_error        | unknown route, model, slot or fault kind                      |
| 405    | invalid_request_error  | wrong method                                                  |
| 409    | conflict_error         | the canary is off                                             |
| 413    | invalid_request_error  | body over the cap                                             |
| 415    | invalid_request_error  | a mutating route without ``Content-Type: application/json``  |
| 429    | rate_limit_error       | the engine's queue is full                                    |
| 500    | server_error           | anything unexpected (logged with its traceback, never sent)  |
| 503    | unavailable_error      | the engine stopped or the server is shutting down             |
| 504    | timeout_error          | a request ran past its time limit (aborted in the engine)     |

Bodies are rendered ASCII-only, so a lone surrogate in any echoed input cannot break encoding.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvcanary.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable_error", 504: "timeout_error"}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (lone surrogates included)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    return AsciiJSONResponse(error_body(status, message, param), status, headers=headers)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|[A-Z][a-z]+[A-Z]\w*)$")


def _param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``; query/path/header names as they are."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _UNION_TAG.match(p):  # pydantic's names of union branches
            continue
        else:
            out += ("." if out else "") + p
    return out or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return "the body is not valid JSON: " + str(first.get("ctx", {}).get("error", "parse error")), None
    if first.get("type") == "extra_forbidden":
        return f"{param}: unknown field; this server does not take it, leave it out", param
    got = first.get("input")
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    msg = first.get("msg", "invalid")
    show = got is not None and param and first.get("type") != "missing"
    return f"{param or 'body'}: {msg}" + (f" (got {shown})" if show else ""), param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with ``error_body`` JSON: ``ApiError``, HTTP errors, request
    validation (400 with ``param``), and a catch-all 500 that logs the traceback and sends none."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def route_error(request: Request, exc: StarletteHTTPException):  # unknown routes, wrong methods
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("kv_canary server: %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error ({type(exc).__name__}); the server log has the details")
