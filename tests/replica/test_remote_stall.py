"""A remote replica whose server freezes (answers nothing, closes nothing) is a stall, as for an
engine process (issue 23): ejected after the stall bound, its streams released with
`ReplicaStalledError` whether they waited for the response or were mid-body, a new request refused
at once while stalled, and recovered once a poll answers again. Also the per-request bounds: a
live server that sends no first token, or stops between tokens, releases that request only."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from tests.replica.test_remote_replica import FakeServer, req, serve

from tokenpath.replica.base import ProgressTimeoutError, ReplicaStalledError
from tokenpath.replica.liveness import LivenessConfig
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig

STALL_S = 1.0


class FreezableServer(FakeServer):
    """Every answer (polls, response heads, stream chunks) waits while `thawed` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.thawed = asyncio.Event()
        self.thawed.set()

    async def _metrics(self) -> PlainTextResponse:
        await self.thawed.wait()
        return await super()._metrics()

    async def _health(self) -> PlainTextResponse:
        await self.thawed.wait()
        return await super()._health()

    async def _completions(self, request: Request):
        body = await request.json()
        await self.thawed.wait()
        silent_first = body.get("user") == "silent"

        async def stream():
            if silent_first:
                await asyncio.sleep(3600)
            for i in range(body["max_tokens"]):
                await self.thawed.wait()
                await asyncio.sleep(0.02)
                last = i == body["max_tokens"] - 1
                choice = {"index": 0, "text": f"w{i} ", "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def replica(url: str, **bounds: float) -> RemoteReplica:
    rep = RemoteReplica("remote-s", RemoteReplicaConfig(url=url, poll_interval_s=0.1, connect_timeout_s=0.4), model="m")
    rep.liveness.config = LivenessConfig(stall_after_s=STALL_S, **bounds)
    return rep


async def test_a_frozen_server_is_ejected_its_streams_released_and_it_recovers():
    fake = FreezableServer()
    async with serve(fake.app) as (url, _):
        rep = replica(url)
        await rep.start()
        assert rep.state().healthy
        outputs: list = []

        async def consume(r):
            async for out in rep.generate(r):
                outputs.append(out)

        streaming = asyncio.create_task(consume(req("mid-body", max_tokens=1000)))
        while len(outputs) < 3:
            await asyncio.sleep(0.01)
        fake.thawed.clear()
        try:
            frozen = time.monotonic()
            waiting = asyncio.create_task(consume(req("no-head-yet", max_tokens=5)))
            for task in (streaming, waiting):
                with pytest.raises(ReplicaStalledError):
                    await asyncio.wait_for(task, STALL_S + 3)
            assert time.monotonic() - frozen < STALL_S + 1.5
            state = rep.state()
            assert not state.healthy and "stalled" in (state.detail or ""), state
            with pytest.raises(ReplicaStalledError):  # refused at once while stalled
                await anext(rep.generate(req("while-stalled")))
        finally:
            fake.thawed.set()  # (else the server's shutdown waits on its frozen handlers)
        deadline = time.monotonic() + 5
        while not rep.state().healthy:
            assert time.monotonic() < deadline, rep.state()
            await asyncio.sleep(0.05)
        assert [o async for o in rep.generate(req("after", max_tokens=3))][-1].finished
        await rep.close()


async def test_per_request_bounds_release_one_request_on_a_live_server():
    fake = FreezableServer()
    async with serve(fake.app) as (url, _):
        rep = replica(url, first_token_s=0.6, next_token_s=30)
        await rep.start()
        start = time.monotonic()
        with pytest.raises(ProgressTimeoutError):
            async for _ in rep.generate(req("silent-one", session="silent")):
                pass
        assert 0.5 < time.monotonic() - start < 2.5
        assert rep.state().healthy  # one slow request is not a stalled replica
        assert [o async for o in rep.generate(req("fine", max_tokens=3))][-1].finished
        await rep.close()
