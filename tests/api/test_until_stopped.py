"""`until_stopped` and `watch_disconnect`: a stop still interrupts a wait for the next output, and
an output ready now reaches the consumer without a turn of the event loop (issue 37: each turn
sat between vLLM's first chunk and the first bytes the client gets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from tokenpath.api.sse import Interrupted, StopSignal, until_stopped, watch_disconnect


async def _ready(items: list[int], closed: list[bool]) -> AsyncGenerator[int, None]:
    try:
        for i in items:
            yield i
    finally:
        closed.append(True)


async def _slow(first: int, closed: list[bool], reached: asyncio.Event) -> AsyncGenerator[int, None]:
    try:
        yield first
        reached.set()
        await asyncio.sleep(3600)
        yield first + 1
    finally:
        closed.append(True)


def _turn_marker() -> list[bool]:
    """A flag set by a callback queued now: still False after an await means the await took no
    turn of the event loop."""
    turned: list[bool] = []
    asyncio.get_running_loop().call_soon(turned.append, True)
    return turned


async def test_a_ready_item_takes_no_turn_of_the_loop() -> None:
    closed: list[bool] = []
    stream = until_stopped(_ready([1, 2], closed), StopSignal())
    turned = _turn_marker()
    assert await anext(stream) == 1
    assert not turned, "the first item waited for a turn of the event loop"
    assert [i async for i in stream] == [2]
    assert closed == [True]


async def test_the_source_runs_in_the_consumers_task() -> None:
    seen: list[asyncio.Task | None] = []

    async def source() -> AsyncGenerator[int, None]:
        for i in range(3):
            seen.append(asyncio.current_task())
            yield i

    assert [i async for i in until_stopped(source(), StopSignal())] == [0, 1, 2]
    assert seen == [asyncio.current_task()] * 3


async def test_a_stop_interrupts_the_wait_and_closes_the_source() -> None:
    closed: list[bool] = []
    reached = asyncio.Event()
    stop = StopSignal()
    stream = until_stopped(_slow(1, closed, reached), stop)
    task = asyncio.current_task()
    assert task is not None
    assert await anext(stream) == 1
    asyncio.get_running_loop().call_later(0.01, stop.set, "disconnect")
    with pytest.raises(Interrupted) as info:
        await anext(stream)
    assert info.value.reason == "disconnect"
    assert closed == [True]
    assert task.cancelling() == 0  # the stop's cancel was taken back: nothing left pending on the task
    await asyncio.sleep(0)  # (and a later await is not cancelled)


async def test_a_stop_set_before_the_next_item_ends_at_once() -> None:
    closed: list[bool] = []
    stop = StopSignal()
    stream = until_stopped(_ready([1, 2, 3], closed), stop)
    assert await anext(stream) == 1
    stop.set("shutdown")
    with pytest.raises(Interrupted):
        await anext(stream)
    await stream.aclose()
    assert closed == [True]


async def test_a_cancel_from_outside_is_not_taken_for_a_stop() -> None:
    closed: list[bool] = []
    reached = asyncio.Event()
    stop = StopSignal()

    async def consume() -> None:
        async for _ in until_stopped(_slow(1, closed, reached), stop):
            pass

    task = asyncio.create_task(consume())
    await reached.wait()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]
    assert not stop.is_set


async def test_a_stop_set_by_the_consuming_task_itself_ends_at_the_next_item() -> None:
    stop = StopSignal()
    got = []
    with pytest.raises(Interrupted):
        async for i in until_stopped(_ready([1, 2, 3], []), stop):
            got.append(i)
            stop.set("shutdown")  # (no wait of its own to interrupt: seen before the next item)
    assert got == [1]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


class _Request:
    """What `watch_disconnect` reads of a request: its ASGI receive, here one that never ends."""

    async def receive(self) -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}


async def test_leaving_watch_disconnect_takes_no_turn_of_the_loop() -> None:
    stop = StopSignal()
    async with watch_disconnect(_Request(), stop):  # type: ignore[arg-type]
        await asyncio.sleep(0)  # (the watcher is waiting on receive)
        turned = _turn_marker()
    assert not turned, "leaving the block waited for the watcher to end"
    await asyncio.sleep(0.01)
    assert not stop.is_set  # the watcher, cancelled, never sets the stop
