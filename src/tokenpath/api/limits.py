"""What a client can make the server hold: header bytes, body bytes, and the time it takes to send them.

`BodyLimitMiddleware` reads the body (up to the limit, within `body_timeout`) before the app runs,
so an oversized body is a 413 without ever being parsed, whether or not it announced a
Content-Length, and a body that trickles in is a 408. It runs before authentication, so these
cheapest refusals cost nothing else. Request *headers* are read by uvicorn before any ASGI code
runs; `header_timeout_protocol` closes a connection whose headers are not complete in time
(uvicorn has no such setting: its keep-alive timeout only covers the idle gap between requests).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenpath.api.errors import error_body
from tokenpath.errors import TokenpathError

UPLOAD_KEY = "tokenpath.upload"  # ASGI scope key: (started, body read, body bytes), monotonic seconds
TRANSPORT_KEY = "tokenpath.transport"  # ASGI scope key: the connection's asyncio transport (uvicorn httptools)
# How a refusal here is still recorded like any other ending (audit row, log line, metrics).
Refuse = Callable[[Request, TokenpathError], Awaitable[Response]]


class TransportRefusal(TokenpathError):
    """Headers or body too large (431, 413), or a body too slow (408): refused before the app ran.
    The connection is closed after the answer (the rest of the body may still be on its way)."""

    error_type = "invalid_request_error"

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message, code=code, headers={"connection": "close"})
        self.status_code = status


async def _send_error(send: Send, err: TransportRefusal) -> None:
    body = json.dumps(error_body(err.message, err.error_type, code=err.code)).encode()
    await send({"type": "http.response.start", "status": err.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int, body_timeout: float = 10.0,
                 refuse: Refuse | None = None) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes
        self.body_timeout = body_timeout
        self.refuse = refuse

    async def _refused(self, scope: Scope, receive: Receive, send: Send, err: TransportRefusal) -> None:
        if self.refuse is None:
            await _send_error(send, err)
            return
        response = await self.refuse(Request(scope), err)
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if header_bytes > self.max_headers:
            await self._refused(scope, receive, send, TransportRefusal(
                431, f"request headers are {header_bytes} bytes, over the limit of {self.max_headers} bytes",
                "headers_too_large"))
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._refused(scope, receive, send, TransportRefusal(
                413, f"request body is {int(declared)} bytes, over the limit of {self.max_body} bytes",
                "body_too_large"))
            return
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._read_body(receive)
        except TimeoutError:
            await self._refused(scope, receive, send, TransportRefusal(
                408, f"the request body did not arrive within {self.body_timeout:g} s; send the whole body at once",
                "request_timeout"))
            return
        if body is _TOO_LARGE:
            await self._refused(scope, receive, send, TransportRefusal(
                413, f"request body is over the limit of {self.max_body} bytes", "body_too_large"))
            return
        if isinstance(body, bytes):
            # The request's upload (headers in -> whole body read): `RequestRun` starts its
            # Timeline here, so the upload is part of `gateway` and explained by an `upload` cause.
            scope[UPLOAD_KEY] = (started, time.monotonic(), len(body))
            await self.app(scope, replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | object | None:
        """The whole body, None when the client left, `_TOO_LARGE` past the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return _TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def header_timeout_protocol(timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline for each request's headers: armed when the
    connection opens and when an idle kept-alive connection receives its next bytes, disarmed when
    the headers are complete. A client that sends nothing on a new connection, or its headers a
    byte at a time, is disconnected after `timeout` seconds. An idle kept-alive connection is
    uvicorn's keep-alive timeout's to close (`timeout_keep_alive`), not this one's."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._idle():
                self._arm()  # the next request's first bytes: its headers are on the clock
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            # The connection's transport, for `SSEResponse`: how much output it still holds for
            # a client that stopped reading, and `abort()` to drop it (the same scope dict the
            # request's cycle runs with; the app starts only on the next loop turn).
            # (uvicorn types the scope as a closed TypedDict; ASGI servers may add keys to it.)
            self.scope[TRANSPORT_KEY] = self.transport  # type: ignore[literal-required]

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


_TOO_LARGE = object()  # `_read_body`'s answer for a body past the limit


def replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body out once, then pass through (so disconnects still arrive)."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
