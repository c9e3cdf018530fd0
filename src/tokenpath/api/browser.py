"""What a web page in the operator's browser may do to this server: as little as a stranger on the net.

A server on loopback with auth off is reachable from any page the operator opens:
- DNS rebinding: a page's own host name resolved to 127.0.0.1 sends requests with *its* name in
  `Host`. With the server bound to loopback, `Host` must be localhost, 127.0.0.1, [::1] or one of
  `--allowed-hosts` (when bound elsewhere, the list is checked only when `--allowed-hosts` is given).
- Cross-site writes: a page may POST a "simple" request (no CORS preflight), e.g. to
  `/reset_prefix_cache`. A browser always sends `Origin` on a cross-origin POST, so a request with
  a non-safe method whose `Origin` is neither this server's own nor in `--allowed-origins` is a 403
  (as is `Sec-Fetch-Site: cross-site`). Clients that are not browsers send no `Origin` and pass.
- CORS: default-deny. `--allowed-origins` (vLLM's flag; `*` for any) lists the origins whose pages
  may read responses; a preflight from any other origin is a 403 without CORS headers.
- Framing: `/dashboard` is sent with `X-Frame-Options: DENY` and a CSP (`dashboard.CSP`).
- The API's schema and docs (`/docs`, `/redoc`, `/openapi.json`) need a key when auth is on,
  unless `--public-docs`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenpath.api.errors import error_body
from tokenpath.errors import TokenpathError
from tokenpath.gateway.base import RequestGuard

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_FRAMED = ("/dashboard",)  # pages: never inside another site's frame


def host_name(value: str) -> str:
    """`Host` without its port, lower-cased; `[::1]:8000` -> `::1`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class BrowserGuardMiddleware:
    def __init__(self, app: ASGIApp, *, guard: Callable[[], RequestGuard], check_hosts: bool,
                 allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = (), public_docs: bool = False,
                 page_headers: Callable[[str], dict[str, str]] | None = None) -> None:
        self.app = app
        self.guard = guard
        self.check_hosts = check_hosts
        self.hosts = {h.lower() for h in LOOPBACK_NAMES} | {host_name(h) for h in allowed_hosts}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}
        self.public_docs = public_docs
        self.page_headers = page_headers or (lambda path: {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method, path = scope["method"], scope["path"]
        host = host_name(headers.get("host", ""))
        if self.check_hosts and host not in self.hosts:
            await _refuse(send, 403, f"Host {headers.get('host', '')[:100]!r} is not allowed: this server answers "
                          "to localhost, 127.0.0.1 and [::1] (add names with --allowed-hosts)", "host_not_allowed")
            return
        origin = headers.get("origin")
        allowed = origin is not None and self._origin_allowed(origin)
        if origin is not None and method == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(send, origin, allowed, headers)
            return
        cross_site = headers.get("sec-fetch-site") == "cross-site" or (
            origin is not None and not _same_origin(origin, headers.get("host", "")))
        if method not in SAFE_METHODS and cross_site and not allowed:
            await _refuse(send, 403, f"cross-site {method} refused: origin {(origin or '')[:100]!r} is not this "
                          "server's and not in --allowed-origins", "cross_site_request")
            return
        if path in DOCS_PATHS and not self.public_docs and not await self._docs_allowed(headers, send):
            return
        extra = self.page_headers(path) if path in _FRAMED else {}
        cors = self._cors_headers(origin) if allowed and origin is not None else {}

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and (extra or cors):
                out = [(k, v) for k, v in message.get("headers", []) if k.decode().lower() not in extra]
                out += [(k.encode(), v.encode()) for k, v in {**extra, **cors}.items()]
                message = {**message, "headers": out}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    def _cors_headers(self, origin: str) -> dict[str, str]:
        return {"access-control-allow-origin": "*" if self.any_origin else origin, "vary": "Origin",
                "access-control-expose-headers": "x-request-id, x-client-request-id, server-timing, retry-after, "
                                                 "x-tokenpath-ignored-fields, x-tokenpath-ignored, "
                                                 "x-tokenpath-reasoning-budget"}

    async def _preflight(self, send: Send, origin: str, allowed: bool, headers: Headers) -> None:
        if not allowed:
            await _refuse(send, 403, f"origin {origin[:100]!r} is not in --allowed-origins (CORS is default-deny)",
                          "origin_not_allowed")
            return
        out = {**self._cors_headers(origin), "access-control-allow-methods": "GET, POST, OPTIONS",
               "access-control-allow-headers": headers.get("access-control-request-headers", "")[:1000],
               "access-control-max-age": "600", "content-length": "0"}
        await send({"type": "http.response.start", "status": 204,
                    "headers": [(k.encode(), v.encode()) for k, v in out.items()]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _docs_allowed(self, headers: Headers, send: Send) -> bool:
        guard = self.guard()
        if not guard.auth_enabled:
            return True
        try:
            await guard.authenticate(headers)
        except TokenpathError as exc:
            body = exc.to_body()
            body["error"]["message"] += " (the API docs need a key when auth is on; or start serve with --public-docs)"
            await _send_json(send, exc.status_code, body)
            return False
        return True


def _same_origin(origin: str, host: str) -> bool:
    try:
        return urlsplit(origin).netloc.lower() == host.strip().lower()
    except ValueError:
        return False


async def _refuse(send: Send, status: int, message: str, code: str) -> None:  # always a 403 today
    await _send_json(send, status, error_body(message, "permission_error", code=code))


async def _send_json(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})

