"""A stream's way to the backend and to its first byte (issue 37): the watchers a request needs
(`api/sse.py`: the disconnect watcher while it waits for its first output, and a stream's
disconnect watcher and stall watchdog) are made at the event loop's next turn, off that way,
without losing what they watch for: a client that leaves, a client that stops reading."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.types import Message

from tokenpath.api.sse import STALLED, SSEResponse, StopSignal, watch_disconnect
from tokenpath.telemetry.timeline import Timeline


def _request(receive) -> Request:  # noqa: ANN001 - an ASGI receive
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_a_block_that_never_waits_makes_no_disconnect_watcher():
    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    before = len(asyncio.all_tasks())
    async with watch_disconnect(_request(receive), StopSignal()):
        assert len(asyncio.all_tasks()) == before
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before  # (and none is made later)


async def test_a_client_that_leaves_while_the_block_waits_is_seen():
    async def receive() -> Message:
        return {"type": "http.disconnect"}

    stop = StopSignal()
    async with watch_disconnect(_request(receive), stop):
        await asyncio.sleep(0.05)  # (waiting for the replica)
    assert stop.is_set and stop.reason == "disconnect"


async def test_a_stream_whose_first_send_blocks_at_once_is_still_found_stalled():
    """The watchdog is made at the loop's next turn: a first event ready at once whose send
    blocks (the client reads nothing) is found at the stall bound all the same."""
    async def events() -> AsyncGenerator[bytes, None]:
        while True:
            yield b"data: {}\n\n"

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def closed() -> None:
        return None

    stop, timeline = StopSignal(), Timeline("r1")
    response = SSEResponse(events(), stop, closed, timeline=timeline, stall_timeout=0.4)
    await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=10)
    assert stop.reason == STALLED
    stall = timeline.attrs["client_stall"]
    assert isinstance(stall, dict) and 0.4 <= stall["found_s"] < 0.4 + 0.25, stall


async def test_a_stream_whose_client_leaves_before_its_first_event_stops():
    async def events() -> AsyncGenerator[bytes, None]:
        await asyncio.sleep(30)  # (the first event waits on the engine)
        yield b"data: {}\n\n"

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def closed() -> None:
        return None

    stop = StopSignal()
    response = SSEResponse(events(), stop, closed)
    task = asyncio.create_task(response({"type": "http"}, receive, send))
    for _ in range(100):
        if stop.is_set:
            break
        await asyncio.sleep(0.01)
    assert stop.reason == "disconnect"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_stream_makes_its_watchers_after_its_first_event_is_sent():
    """Neither the disconnect watcher nor the stall watchdog is made on the way to the first
    byte (before: two tasks made ahead of the headers); both exist once the writer waits."""
    before = len(asyncio.all_tasks())
    counts: list[int] = []
    more = asyncio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"
        await more.wait()  # (the writer waits for the engine's next output)
        yield b"data: 2\n\n"

    async def send(message: Message) -> None:
        counts.append(len(asyncio.all_tasks()))

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def closed() -> None:
        return None

    stop = StopSignal()
    task = asyncio.create_task(SSEResponse(events(), stop, closed)({"type": "http"}, receive, send))
    for _ in range(3):
        await asyncio.sleep(0)
    assert counts[:2] == [before + 1, before + 1]  # (the headers and the first event: the writer's task only)
    assert len(asyncio.all_tasks()) == before + 3  # (waiting: the writer, the watcher, the watchdog)
    more.set()
    await asyncio.wait_for(task, timeout=5)
    assert len(asyncio.all_tasks()) == before  # (all ended with the stream)
