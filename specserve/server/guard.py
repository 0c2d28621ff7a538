"""ASGI middleware in front of every route: browser safety, body type, and the drain.

A server on a developer's machine is reachable by every web page their browser opens. Three
checks keep those pages out, none of which bothers a non-browser client:
- cross-origin requests (an `Origin` that is not the server's own) are refused unless
  --allowed-origins lists the origin; a listed origin gets CORS headers and preflight answers;
- POST bodies must be `application/json`, which a page can only send after a CORS preflight
  (a form or a no-cors fetch sends text/plain, form-encoded or no type);
- bound to loopback, the `Host` header must name loopback (DNS rebinding points an attacker's
  host name at 127.0.0.1: the browser then calls it same-origin, but its Host gives it away).

The drain: once it starts, new requests get 503 and the requests in flight are counted so the
server can wait for them (step_launch.py).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from specserve.server.errors import ServerError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_PREFLIGHT_MAX_AGE = "600"


@dataclass
class DrainState:
    draining: bool = False
    in_flight: int = 0


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name part of a Host header: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    def __init__(
        self,
        app: Any,
        allowed_origins: list[str] | None,
        check_host: bool,
        allowed_hosts: list[str] | None,
        drain: DrainState,
    ) -> None:
        self.app = app
        self.any_origin = "*" in (allowed_origins or [])
        self.origins = frozenset(o.rstrip("/").lower() for o in allowed_origins or [])
        self.check_host = check_host
        self.hosts = frozenset(h.lower() for h in allowed_hosts or [])
        self.drain = drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.check_host and host and not self._host_ok(host):
            err = ServerError(
                f"Host {host!r} is not a loopback name; this server is bound to loopback "
                "(start it with --allowed-hosts to accept other names)",
                403,
                code="host_not_allowed",
            )
            await _send_error(err, scope, receive, send)
            return
        cors: list[tuple[bytes, bytes]] = []
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, host):
            if not (self.any_origin or origin.rstrip("/").lower() in self.origins):
                err = ServerError(
                    f"cross-origin request from {origin!r} refused (start the server with "
                    "--allowed-origins to allow it)",
                    403,
                    code="origin_not_allowed",
                )
                await _send_error(err, scope, receive, send)
                return
            cors = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
            ]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await self._preflight(headers, cors, scope, receive, send)
                return
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                err = ServerError(
                    f"request bodies must be application/json, got {ctype or 'no Content-Type'!r}",
                    415,
                    code="unsupported_media_type",
                )
                await _send_error(err, scope, receive, send, cors)
                return
        if self.drain.draining:
            err = ServerError("the server is shutting down", 503, code="shutting_down")
            await _send_error(err, scope, receive, send, cors)
            return
        if cors:
            send = _with_headers(send, cors)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    def _host_ok(self, host: str) -> bool:
        name = _host_name(host)
        return is_loopback(name) or name.lower() in self.hosts

    async def _preflight(
        self, headers: dict[str, str], cors: list, scope: dict, receive: Any, send: Any
    ) -> None:
        allow = [
            *cors,
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE.encode()),
        ]
        response = Response(status_code=204)
        response.raw_headers.extend(allow)
        await response(scope, receive, send)


def _same_origin(origin: str, host: str) -> bool:
    return bool(host) and origin.lower() in (f"http://{host}".lower(), f"https://{host}".lower())


def _with_headers(send: Any, extra: list[tuple[bytes, bytes]]) -> Any:
    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


async def _send_error(
    err: ServerError, scope: dict, receive: Any, send: Any, extra: list | None = None
) -> None:
    response = JSONResponse(err.response().model_dump(), err.status)
    response.raw_headers.extend(extra or [])
    await response(scope, receive, send)
