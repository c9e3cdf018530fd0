"""Server-sent events, and the watchers that stop a generation when its client goes away.

`SSEResponse` is a small ASGI response rather than Starlette's `StreamingResponse` so that the
ways a stream can end are explicit and all close the generation (which aborts it in the engine
and frees its KV blocks): the events run out, the client disconnects (seen on the ASGI receive
channel), the send fails, or the client stops reading (a send waits past the stall bound, or too
much output waits for it: `client_stalled`). `watch_disconnect` does the same for non-streaming
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenpath.api.limits import TRANSPORT_KEY
from tokenpath.protocol.limits import STREAM_UNSENT_BYTES
from tokenpath.telemetry.timeline import Timeline

DONE = "[DONE]"
SEND_BLOCKED_S = 0.02  # one send longer than this waited on the client (see SSEResponse)
STALLED = "client_stalled"  # the StopSignal reason (and finish reason) of a client that stopped reading
STALL_TIMEOUT_S = 30.0  # the defaults of ApiSettings.stream_stall_timeout and stream_max_unsent
T = TypeVar("T")


# One encoder for every event: `json.dumps` with arguments builds a new JSONEncoder per call, ~30%
# of an event's encoding (issue 37: each chunk of each stream). It keeps no state between calls.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def sse_event(data: dict | str) -> bytes:
    """One `data:` event. JSON never contains a raw newline, so one line per event is safe."""
    payload = data if isinstance(data, str) else _ENCODE(data)
    return f"data: {payload}\n\n".encode()


class _Interrupt:
    """One task's wait that a `StopSignal` cancels when set; `fired` says it did (so the task's
    `CancelledError` is the stop's, and is taken back)."""

    __slots__ = ("task", "fired", "_set")

    def __init__(self, task: asyncio.Task, waiting: set[_Interrupt]) -> None:
        self.task, self.fired, self._set = task, False, waiting

    def fire(self) -> None:
        try:
            current = asyncio.current_task()
        except RuntimeError:  # (set off the loop: no task of ours is running)
            current = None
        if self.task is not current:  # (set by the waiting task itself: it sees `is_set` next)
            self.fired = True
            self.task.cancel()

    def cancel(self) -> None:
        self._set.discard(self)


class StopSignal:
    """Why a generation should stop early: the client left, or the server is shutting down."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None
        self._waiting: set[_Interrupt] = set()

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()
            waiting, self._waiting = self._waiting, set()
            for watch in waiting:
                watch.fire()

    def interrupt(self, task: asyncio.Task) -> _Interrupt:
        """Cancel `task` when this signal is set, until the returned watch is cancelled: how a
        task waiting for a generation's next output is woken by a stop (`until_stopped`)."""
        watch = _Interrupt(task, self._waiting)
        self._waiting.add(watch)
        return watch

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

    Each item is awaited in the consumer's own task: while it waits, `stop` cancels that wait
    (`StopSignal.interrupt`), and the cancel is taken back here as `Interrupted`. A task per item
    raced against the stop event (the way before) cost a task, an `asyncio.wait` and two more
    turns of the event loop on every output, the first token's included (issue 37: the gateway's
    added TTFT in front of vLLM).
    """
    try:
        while True:
            if stop.is_set:
                raise Interrupted(stop.reason)
            task = asyncio.current_task()
            if task is None:  # (no task: nothing to cancel, so nothing to race)
                raise RuntimeError("until_stopped must be iterated inside an asyncio task")
            watch = stop.interrupt(task)
            try:
                item = await anext(source)
            except StopAsyncIteration:
                if watch.fired:
                    task.uncancel()  # (it ended as the stop came: nothing left to interrupt)
                return
            except asyncio.CancelledError:
                if watch.fired and task.uncancel() == 0:
                    raise Interrupted(stop.reason) from None  # our own cancel: the stop, not the caller
                raise
            finally:
                watch.cancel()
            if watch.fired:  # (the source took the cancel and still gave an item: the stop holds)
                task.uncancel()
                raise Interrupted(stop.reason)
            yield item
    finally:
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


class NextTurnTasks:
    """Tasks made at the loop's next turn, not now: a task made on a request's way to the backend
    or to its first byte would first run at that turn anyway (once the request waits), and making
    it there was on the path (issue 37). `cancel` before that turn makes none."""

    def __init__(self, *make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.tasks: list[asyncio.Task] = []
        self._starting = asyncio.get_running_loop().call_soon(self._start, make)

    def _start(self, make: tuple[Callable[[], Coroutine[Any, Any, None]], ...]) -> None:
        self.tasks = [asyncio.create_task(m()) for m in make]

    def cancel(self) -> list[asyncio.Task]:
        """Cancel them (or their making); the tasks made, for a caller that waits for their end."""
        self._starting.cancel()
        for task in self.tasks:
            task.cancel()
        return self.tasks


@contextlib.asynccontextmanager
async def watch_disconnect(request: Request, stop: StopSignal) -> AsyncIterator[None]:
    """While the block runs, a client disconnect sets `stop` (non-streaming requests, and a
    stream's wait for its first output). A block that ends before the loop's next turn needs no
    watcher, and gets none (`NextTurnTasks`)."""

    async def watch() -> None:
        await _wait_for_disconnect(request.receive)
        stop.set("disconnect")

    watcher = NextTurnTasks(watch)
    try:
        yield
    finally:
        # Cancelled, not awaited: once cancelled it can no longer set `stop`, and waiting for it to
        # end took three turns of the event loop after the block's own work was done, between a
        # stream's first token and its headers (issue 37). A disconnect it missed is still there
        # for the next reader of `receive` (uvicorn answers every later call with it).
        watcher.cancel()


class ClientStalled(Exception):
    """The client took nothing for the stall bound, or left more than the cap unsent."""


def _buffered(transport: asyncio.WriteTransport | None) -> int:
    """Bytes the connection's transport holds that the socket has not taken (0 if unknown)."""
    if transport is None:
        return 0
    try:
        return transport.get_write_buffer_size()
    except Exception:  # a transport closing under us, or one that does not count
        return 0


class SSEResponse(Response):
    """A stream that ends whichever way its client goes: disconnects, or stops reading.

    One loop pulls each event as the generation makes it and sends it. A client that stops reading
    makes a send wait on the full socket (the server's flow control holds the writer until the
    client reads): while the writer waits nothing more is pulled, so what waits for the client is
    bounded by the transport's buffer, and the rest stays unmade in the engine. A send that waited
    `stall_timeout` seconds, or a transport holding over `max_unsent` bytes before a send, ends the
    stream as `client_stalled`: the generation is closed (the engine aborts it and frees its KV
    blocks and slot; admission gets its slot back) and the connection is dropped with what it held.

    The stall bound is kept by one watchdog task per stream that wakes every quarter of the bound
    (so a stall is seen within 1.25x of it) and looks at when the send in progress began: per event
    the writer only notes that time, two attribute writes, where a timer per send cost ~5x the
    whole event's CPU (`benchmarks/sse_cpu.py`).

    A stalled stream's Timeline gets `client_stall`: from the start of the send that waited (its
    writes blocking), the seconds until the stall was found (`found_s`) and until its generation
    was closed (`freed_s`: the engine's abort sent, which it applies before its next step, and the
    admission slot given back). The product's bound is `freed_s` within 1.25x `stall_timeout`;
    `benchmarks/slow_reader_flood.py` reads it per stream from the audit row's timing.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        stop: StopSignal,
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
        timeline: Timeline | None = None,
        stall_timeout: float = STALL_TIMEOUT_S,
        max_unsent: int = STREAM_UNSENT_BYTES.value,
    ) -> None:
        self.events = events
        self.timeline = timeline
        self.stop = stop
        self.on_close = on_close
        self.stall_timeout = stall_timeout
        self.max_unsent = max_unsent
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
        self._sending_since: float | None = None  # monotonic start of the send in progress
        self._stalled = False
        self._stall: tuple[float, float] | None = None  # (blocked since, found at), monotonic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            await _wait_for_disconnect(receive)
            self.stop.set("disconnect")

        writer = asyncio.current_task()
        # The disconnect watcher and the stall watchdog, made at the loop's next turn (once this
        # writer waits: for the next event, or on a send the client pushes back), not on the way
        # to the first byte.
        watchers = NextTurnTasks(watch, *([lambda: self._watchdog(writer)] if writer is not None else []))
        transport = scope.get(TRANSPORT_KEY)
        blocked = 0.0
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # A send that waits is the client's socket pushing back (the server's write buffer is
            # full until the client reads): the request's slow_client cause. Only sends over
            # SEND_BLOCKED_S count: a send also gives up the GIL for its syscall and can wait a
            # switch interval (5 ms) or two to get it back from the engine thread, which is not
            # the client's doing. Two clock reads per event.
            clock = time.monotonic
            # The first event's send is the Timeline's `first_sent` (the gateway's own time from the
            # backend's first token to the client's first byte: `Timeline.own_path`).
            stamp_first = self.timeline.stamp if self.timeline is not None else None
            async for chunk in self.events:
                if transport is not None and _buffered(transport) > self.max_unsent:
                    now = clock()
                    self._stall = (now, now)  # (no send waited: the cap, found before one)
                    raise ClientStalled
                self._sending_since = t0 = clock()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending_since = None
                t1 = clock()
                if stamp_first is not None:
                    stamp_first("first_sent", at=t1)
                    stamp_first = None
                took = t1 - t0
                if took > SEND_BLOCKED_S:
                    blocked += took
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientStalled, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if not self._stalled or writer is None:
                    raise  # (the server's own cancel: a shutdown)
                writer.uncancel()  # (the watchdog's: consumed here)
            self.stop.set(STALLED)
            if transport is not None:
                transport.abort()  # drop what it holds now: close() would keep it until the client reads
        except OSError:
            self.stop.set("disconnect")  # the socket is gone; nothing more can be sent
        finally:
            self._sending_since = None
            if self.timeline is not None and blocked:
                self.timeline.attrs["client_blocked_s"] = round(blocked, 6)
            await asyncio.gather(*watchers.cancel(), return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()  # (closes the generation: the engine's abort, the slot back)
            if self._stall is not None and self.timeline is not None:
                since, found = self._stall
                self.timeline.attrs["client_stall"] = {"found_s": round(found - since, 4),
                                                       "freed_s": round(time.monotonic() - since, 4)}
            await self.on_close()

    async def _watchdog(self, writer: asyncio.Task) -> None:
        """Cancel the writer once a send has waited past the stall bound. It looks every quarter of
        the bound, and while a send waits it wakes at that send's bound itself, not at the next
        quarter after it: a stall is then found at the bound plus the event loop's lateness, not
        up to a quarter later (a flood of 200 found at up to 6.25 s of a 5 s bound, 1.25x with
        no room left for a loaded loop's lateness)."""
        every = max(0.05, self.stall_timeout / 4)
        while True:
            since = self._sending_since
            now = time.monotonic()
            if since is not None and now - since >= self.stall_timeout:
                self._stalled = True
                self._stall = (since, now)
                writer.cancel()
                return
            await asyncio.sleep(every if since is None else min(every, since + self.stall_timeout - now))
