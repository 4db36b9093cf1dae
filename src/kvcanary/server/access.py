"""Who may reach what: the Host check, the JSON-only rule for mutating routes, the body cap, and
the exposure rule for binding beyond loopback.

| rule                  | answer                                                                  |
|-----------------------|-------------------------------------------------------------------------|
| Host not allowed      | 400: a page on another origin that resolves its name to us (DNS rebinding) |
|                       | is refused; the allowed names follow from the bind address               |
| POST without JSON     | 415: a cross-site form or ``fetch`` with a "simple" content type cannot  |
|                       | arm a fault or run a sweep (a JSON POST needs a CORS preflight, never granted) |
| body over the cap     | 413, before the route runs                                              |

The bearer token (``AdminConfig.token``) guards every route that changes state or reveals cached
content; ``kv-canary serve`` refuses to bind beyond loopback without one unless told otherwise.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvcanary.server.errors import error_response

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
MUTATING = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE"})


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class AccessConfig:
    """``allowed_hosts``: names the Host header may carry (any port; None: any name);
    ``max_body_bytes``: the largest request body accepted."""

    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES
    max_body_bytes: int = 1 << 20

    def __post_init__(self):
        if self.allowed_hosts is not None and (not self.allowed_hosts or not all(
                isinstance(h, str) and h for h in self.allowed_hosts)):
            raise ValueError(f"AccessConfig.allowed_hosts must be None or non-empty names, got {self.allowed_hosts!r}")
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1024:
            raise ValueError(f"AccessConfig.max_body_bytes must be an int >= 1024, got {self.max_body_bytes!r}")

    @classmethod
    def for_bind(cls, host: str, extra_hosts: tuple[str, ...] = (), max_body_bytes: int = 1 << 20) -> AccessConfig:
        """Allowed Host names for a server bound to ``host``: the loopback names on loopback; the
        address itself (and ``extra_hosts``) elsewhere; any name on a wildcard bind without
        ``extra_hosts``."""
        if is_loopback(host):
            names = (*LOOPBACK_NAMES, *extra_hosts)
        elif is_wildcard(host):
            names = (*LOOPBACK_NAMES, *extra_hosts) if extra_hosts else None
        else:
            names = (host, *extra_hosts)
        return cls(tuple(dict.fromkeys(h.lower() for h in names)) if names else None, max_body_bytes)


def host_name(header: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"Example.com:80"`` -> ``"example.com"``."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class AccessMiddleware:
    """ASGI middleware applying ``AccessConfig`` to every HTTP request; it buffers the body (up to
    the cap) and hands it on, so a route never reads more than the cap."""

    def __init__(self, app, config: AccessConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        refusal = self._refusal(scope, headers)
        body = b""
        if refusal is None:
            body, refusal = await self._read_body(receive)
            if body is None:  # the client left before its body arrived
                return
        if refusal is not None:
            return await refusal(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refusal(self, scope, headers: dict):
        allowed = self.config.allowed_hosts
        host = headers.get(b"host", b"").decode("latin-1")
        if allowed is not None and host_name(host) not in allowed:
            return error_response(400, f"Host header {host[:100]!r} is not a name of this server; allowed: "
                                       f"{', '.join(allowed)} (start the server with --allowed-host to add one)",
                                  "Host")
        if scope["method"].encode() in MUTATING:
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if ctype != "application/json":
                return error_response(415, f"{scope['method']} {scope['path']} needs 'Content-Type: application/json', "
                                           f"got {ctype[:60]!r}; send a JSON body ({{}} when there is nothing to say)",
                                      "Content-Type")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return error_response(400, f"Content-Length {length[:40]!r} is not an integer", "Content-Length")
            if n > self.config.max_body_bytes:
                return self._too_large(n)
        return None

    def _too_large(self, n: int | str):
        return error_response(413, f"request body of {n} bytes exceeds the cap of {self.config.max_body_bytes} "
                                   "bytes; send fewer or shorter prompts")

    async def _read_body(self, receive):
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.config.max_body_bytes:
                return b"", self._too_large(f"more than {self.config.max_body_bytes}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def exposure_warning(host: str, routes: list[str]) -> str:
    """The warning for a server bound to ``host`` beyond loopback without a token."""
    return (f"binding {host} without --admin-token: anyone who reaches it can use every route: "
            + ", ".join(routes))
