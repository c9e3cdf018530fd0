"""The gateway's CPU per streamed event in `SSEResponse`, apart from everything else.

32 concurrent streams of 256 events each through `api.sse.SSEResponse`, events produced as a
generation makes them (one `await asyncio.sleep(0)` between tokens, as outputs arrive from the
engine) and an ASGI `send` that takes each message at once (a client that reads). Reported:
`time.process_time()` per event, median over rounds. CPU time, not wall time: another process on
the box moves it little, so two versions can be compared on a busy machine.

    PYTHONPATH=src .venv/bin/python benchmarks/sse_cpu.py [--rounds 9]

To compare two versions, run it from each checkout (its own `src` on PYTHONPATH), alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from tokenpath.api.sse import SSEResponse, StopSignal

STREAMS, EVENTS = 32, 256
CHUNK = b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" x"}}]}\n\n'


async def _events(n: int):  # noqa: ANN202
    for _ in range(n):
        await asyncio.sleep(0)
        yield CHUNK


async def _stream() -> int:
    sent = 0
    never = asyncio.Event()

    async def receive() -> dict:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal sent
        sent += len(message.get("body", b""))

    async def done() -> None:
        return None

    await SSEResponse(_events(EVENTS), StopSignal(), done)({"type": "http"}, receive, send)
    return sent


async def _round() -> float:
    t0 = time.process_time()
    sizes = await asyncio.gather(*(_stream() for _ in range(STREAMS)))
    assert all(s == EVENTS * len(CHUNK) for s in sizes), sizes
    return (time.process_time() - t0) / (STREAMS * EVENTS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    gc.freeze()
    asyncio.run(_round())  # warm-up
    per = [asyncio.run(_round()) for _ in range(args.rounds)]
    print(f"sse_cpu: {statistics.median(per) * 1e6:.2f} us per event (median of {args.rounds}; "
          f"min {min(per) * 1e6:.2f}, max {max(per) * 1e6:.2f}); {STREAMS} streams x {EVENTS} events")


if __name__ == "__main__":
    main()
