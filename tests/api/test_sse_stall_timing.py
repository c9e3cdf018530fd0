"""When `SSEResponse` finds a stream stalled, measured from its writes blocking (issue 41).

A send that never returns (a client that stopped reading: the server's flow control holds the
writer) must be found at the stall bound, not at the watchdog's next quarter-of-the-bound look
after it: a stream whose send began just after a look was found up to a quarter late (2.4 s of a
2 s bound here), which left the product's 1.25x rule no room for a late event loop (a flood of 200
freed its worst stream at 6.25 s of a 5 s bound, benchmarks/results/slow_reader_flood.md). And the
stall's timing reaches the Timeline, from which the audit row's timing carries it per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Message

from tokenpath.api.sse import STALLED, SSEResponse, StopSignal
from tokenpath.telemetry.timeline import Timeline

STALL_S = 2.0  # the watchdog looks every 0.5 s
LATE_S = 0.25  # found later than the bound by more than this: a quarter-step late (0.4 s here)


async def test_a_send_that_never_returns_is_found_at_the_bound_and_timed():
    async def events() -> AsyncGenerator[bytes, None]:
        await asyncio.sleep(0.1)  # the blocking send starts between two of the watchdog's looks
        while True:
            yield b"data: {}\n\n"

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client never reads: this send never completes

    async def receive() -> Message:
        await asyncio.Event().wait()  # (no disconnect)
        raise AssertionError("unreachable")

    async def closed() -> None:
        return None

    stop, timeline = StopSignal(), Timeline("r1")
    response = SSEResponse(events(), stop, closed, timeline=timeline, stall_timeout=STALL_S)
    await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=30)
    assert stop.reason == STALLED
    stall = timeline.attrs["client_stall"]
    assert isinstance(stall, dict), stall
    assert STALL_S <= stall["found_s"] <= stall["freed_s"], stall
    assert stall["found_s"] < STALL_S + LATE_S, stall  # (2.4 s before: the look after the bound)
