"""A request's output deltas as the handler reads them, merged from several generations.

A batched completions request runs its prompts concurrently, and a reasoning budget runs one
continuation per choice it cut (`api/thinking.py`): both read their generations as one stream of
(index, delta), and closing that stream closes (so aborts in the engine) every generation in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from tokenpath.protocol.outputs import RequestOutput

# A request's outputs as the handler reads them: (prompt index, delta), closed with `aclose`.
Deltas = AsyncGenerator[tuple[int, RequestOutput], None]


async def merge(sources: list[AsyncGenerator[RequestOutput, None]]) -> Deltas:
    """(index in `sources`, delta) from several concurrent generations; closing it closes them all."""
    if len(sources) == 1:
        try:
            async for out in sources[0]:
                yield 0, out
        finally:
            await sources[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, src: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in src:
                await queue.put((i, out, None))
            await queue.put((i, None, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        finally:
            await src.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
