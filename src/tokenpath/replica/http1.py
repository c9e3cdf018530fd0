"""A lean HTTP/1.1 client for the one request on a URL replica's hot path: the streamed generation.

Measured in front of vLLM CPU (benchmarks/results/vllm_behind_gateway-loaded-ab.md): a bare
uvicorn pass-through relaying vLLM's stream through httpx added ~4 ms to TTFT p50 (and ~3.5 ms of
CPU per request on a two-core machine), the same pass-through on an asyncio protocol with
httptools' C parser (already installed with uvicorn[standard]) ~0.1 ms. httpx's layers (client,
transport, httpcore's pool, h11's pure-Python parser, anyio streams) are that difference; this
module is the part of them the generate call needs, and nothing else:

- plain `http://` only, keep-alive connections pooled and dropped when idle for `keepalive_s`
  (less than the server's own keep-alive, as the httpx client's `keepalive_expiry` was);
- a connect timeout, and a read timeout for each wait on the server;
- chunked or sized bodies (httptools decodes both); a body that waits unread past
  `PAUSE_READING_BYTES` pauses the socket, so a slow consumer pushes back on the server as before;
- closing a response before its end closes its connection (the server sees the disconnect and
  aborts the request, as vLLM and tokenpath both do).

The replica's polls (`/health`, `/metrics`, `/slots`, 4 a second) take it too: on httpx they were
the largest share of the gateway's own CPU (py-spy). Everything else (`/v1/models` at start,
HTTPS, a proxy from the environment) stays on httpx: `RemoteReplica` takes this path only for
`http://` URLs that no proxy applies to.
Errors are `Http1Error` (connection refused, closed or cut mid-body, a malformed response, a
timeout), which the replica maps as it maps httpx's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import httptools

PAUSE_READING_BYTES = 1 << 20  # unread body bytes before the socket is paused (back-pressure to the server)


class Http1Error(Exception):
    """The backend could not be reached, or its response broke off or did not parse."""


def lean_applies(url: str) -> bool:
    """Whether `url` can take this client: plain http, and no proxy from the environment for it."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = getproxies()
    return not (proxies.get("http") or proxies.get("all")) or bool(proxy_bypass(parts.hostname))


class Http1Response:
    """One response, read as it arrives. `status_code` is set when the headers are in."""

    def __init__(self, conn: _Conn, read_timeout: float) -> None:
        self._conn = conn
        self._read_timeout = read_timeout
        self.status_code = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._headers_in = False
        self.complete = False
        self._error: Http1Error | None = None
        self._wake: asyncio.Future[None] | None = None
        self.content = b""
        self.sent_at: float | None = None  # monotonic time the request was written (the Timeline's `sent`)

    # -- fed by the connection ---------------------------------------------------------------
    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _fail(self, error: Http1Error) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._notify()

    # -- read by the caller ------------------------------------------------------------------
    async def _wait(self) -> None:
        """Until the connection has news. The read timeout is one timer handle that fails the wait
        (`call_at`, cancelled when news comes), not `asyncio.timeout`: a `Timeout` object, its
        reschedule and the task's cancel bookkeeping on every wait, i.e. every chunk of every
        stream, were ~4% of the gateway's CPU per request in front of vLLM (cProfile, issue 37)."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = loop.call_at(loop.time() + self._read_timeout, self._timed_out, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None
        if self._error is not None:
            raise self._error

    def _timed_out(self, wake: asyncio.Future[None]) -> None:
        if not wake.done():
            wake.set_exception(Http1Error(f"no data from the server for {self._read_timeout} s"))

    async def _headers(self) -> None:
        while not self._headers_in:
            await self._wait()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                self._conn.resume()
                yield b"".join(chunks)
            elif self.complete:
                return
            else:
                await self._wait()

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Text lines (LF or CRLF), as an SSE stream is read."""
        rest = b""
        async for data in self.aiter_bytes():
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
        if rest:
            yield rest.removesuffix(b"\r").decode("utf-8", errors="replace")

    async def aread(self) -> bytes:
        self.content = b"".join([x async for x in self.aiter_bytes()])
        return self.content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    async def aclose(self) -> None:
        """Stop reading: a response not read to its end takes its connection with it."""
        if not self.complete:
            self._conn.close()
            self._fail(Http1Error("response closed before its end"))


class _Conn(asyncio.Protocol):
    """One keep-alive connection; httptools calls the `on_*` methods from `data_received`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Http1Response | None = None
        self.lost = False
        self.paused = False
        self.keep_alive = False  # the last response's keep-alive, as its end said it
        self.framed = False  # the response in progress has a length or chunks (else: read to close)
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # nothing was asked: a server that talks unasked is not reused
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.resp._fail(Http1Error(f"malformed response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        resp = self.resp
        if resp is not None and resp._headers_in and not self.framed and exc is None:
            resp.complete = True  # (a body with no length and no chunks ends where the connection does)
            resp._notify()
        elif resp is not None:
            resp._fail(Http1Error(f"connection closed by the server{f': {exc}' if exc else ''}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp.status_code = self.parser.get_status_code()
            self.resp._headers_in = True
            self.resp._notify()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._chunks.append(bytes(body))
            resp._buffered += len(body)
            if resp._buffered > PAUSE_READING_BYTES and self.transport is not None and not self.paused:
                self.paused = True
                self.transport.pause_reading()
            resp._notify()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # (read now: after this it says False)
        if self.resp is not None:
            self.resp.complete = True
            self.resp._notify()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def reusable(self) -> bool:
        return (not self.lost and self.transport is not None and not self.transport.is_closing()
                and self.keep_alive)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class Http1Pool:
    """Keep-alive connections to one `http://host:port`, for streamed POSTs with a bytes body."""

    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout: float, read_timeout: float,
                 keepalive_s: float = 4.0, max_idle: int = 64) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Pool: an http:// URL is needed, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        host = parts.netloc.rsplit("@", 1)[-1]
        self._head = f"Host: {host}\r\nAccept: */*\r\nUser-Agent: tokenpath\r\n" + _header_lines(headers)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.keepalive_s, self.max_idle = keepalive_s, max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except TimeoutError:
            raise Http1Error(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise Http1Error(f"connect to {self.host}:{self.port}: {exc}") from exc
        return conn

    async def get(self, path: str) -> Http1Response:
        """A whole GET (the replica's polls): the response with its body read."""
        async with self.stream("GET", path, None, {}) as resp:
            await resp.aread()
        return resp

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, body: bytes | None,
                     headers: dict[str, str]) -> AsyncIterator[Http1Response]:
        """Send the request (`body`: JSON, or None for none); yield its response once the headers
        are in (read the body from it)."""
        sized = "" if body is None else f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}{_header_lines(headers)}{sized}\r\n"
        conn = await self._connect()
        resp = conn.resp = Http1Response(conn, self.read_timeout)
        conn.parser, conn.keep_alive, conn.framed = httptools.HttpResponseParser(conn), False, False
        try:
            if conn.transport is None or conn.lost:
                raise Http1Error("connection closed before the request was sent")
            conn.transport.write(head.encode("latin-1") + (body or b""))
            resp.sent_at = time.monotonic()
            await resp._headers()
            yield resp
        except BaseException:
            conn.close()
            raise
        finally:
            conn.resp = None
            if resp.complete and conn.reusable() and len(self._idle) < self.max_idle:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _header_lines(headers: dict[str, str]) -> str:
    """`Name: value` lines; a name or value with a line break (header injection) is refused."""
    out = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0") or ":" in name:
            raise ValueError(f"invalid HTTP header {name!r}")
        out.append(f"{name}: {value}\r\n")
    return "".join(out)
