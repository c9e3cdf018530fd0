"""ASGI middleware that bounds what a client can make the server hold: header bytes and body
bytes. The body is read (up to the limit) before the app runs, so an oversized body is a 413
without ever being parsed, whether or not it announced a Content-Length."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenpath.api.errors import error_body


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if header_bytes > self.max_headers:
            await _send_error(send, 431, f"request headers are {header_bytes} bytes, over the limit of "
                              f"{self.max_headers} bytes", "headers_too_large")
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _send_error(send, 413, f"request body is {int(declared)} bytes, over the limit of "
                              f"{self.max_body} bytes", "body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _send_error(send, 413, f"request body is over the limit of {self.max_body} bytes",
                                  "body_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body out once, then pass through (so disconnects still arrive)."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
