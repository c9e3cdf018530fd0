"""Server-sent events, and the watchers that stop a generation when its client goes away.

`SSEResponse` is a small ASGI response rather than Starlette's `StreamingResponse` so that the
three ways a stream can end are explicit and all close the generation (which aborts it in the
engine and frees its KV blocks): the events run out, the client disconnects (seen on the ASGI
receive channel), or the send fails. `watch_disconnect` does the same for non-streaming requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenpath.telemetry.timeline import Timeline

DONE = "[DONE]"
SEND_BLOCKED_S = 0.02  # one send longer than this waited on the client (see SSEResponse)
T = TypeVar("T")


def sse_event(data: dict | str) -> bytes:
    """One `data:` event. JSON never contains a raw newline, so one line per event is safe."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"data: {payload}\n\n".encode()


class StopSignal:
    """Why a generation should stop early: the client left, or the server is shutting down."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


class Interrupted(Exception):
    def __init__(self, reason: str | None) -> None:
        super().__init__(reason)
        self.reason = reason


async def until_stopped(source: AsyncGenerator[T, None], stop: StopSignal) -> AsyncGenerator[T, None]:
    """Yield from `source` until it ends or `stop` is set (then raise `Interrupted`).

    The source is always closed on the way out, which is what aborts the request in the engine.
    """
    stop_wait = asyncio.ensure_future(stop.event.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({nxt, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
                raise Interrupted(stop.reason)
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop_wait.cancel()
        with contextlib.suppress(Exception):
            await source.aclose()


async def race_stop(coro: Awaitable[T], stop: StopSignal) -> T:
    """Await `coro` unless `stop` is set first (then cancel it and raise `Interrupted`)."""
    task = asyncio.ensure_future(coro)
    stop_wait = asyncio.ensure_future(stop.event.wait())
    try:
        done, _ = await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            raise Interrupted(stop.reason)
        return task.result()
    finally:
        stop_wait.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def watch_disconnect(request: Request, stop: StopSignal) -> AsyncIterator[None]:
    """While the block runs, a client disconnect sets `stop` (non-streaming requests)."""

    async def watch() -> None:
        await _wait_for_disconnect(request.receive)
        stop.set("disconnect")

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        stop: StopSignal,
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.events = events
        self.timeline = timeline
        self.stop = stop
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            await _wait_for_disconnect(receive)
            self.stop.set("disconnect")

        watcher = asyncio.create_task(watch())
        blocked = 0.0
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # A send that waits is the client's socket pushing back (the server's write buffer is
            # full until the client reads): the request's slow_client cause. Only sends over
            # SEND_BLOCKED_S count: a send also gives up the GIL for its syscall and can wait a
            # switch interval (5 ms) or two to get it back from the engine thread, which is not
            # the client's doing. Two clock reads per event.
            clock = time.monotonic
            async for chunk in self.events:
                t0 = clock()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                took = clock() - t0
                if took > SEND_BLOCKED_S:
                    blocked += took
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.stop.set("disconnect")  # the socket is gone; nothing more can be sent
        finally:
            if self.timeline is not None and blocked:
                self.timeline.attrs["client_blocked_s"] = round(blocked, 6)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()
            await self.on_close()
