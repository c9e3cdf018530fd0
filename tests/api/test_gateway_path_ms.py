"""The gateway's own share of a URL replica's time to first byte, from its Timeline (issue 37):
`sent` (the request written to the backend) and `first_sent` (the reply's first byte handed to
the client), reported on the request log line as `gateway_path_ms`.

Through the real app on loopback, in front of a small OpenAI-compatible backend that holds its
first token `HOLD_S` after the request reached it. What the gateway says it spent before the
backend and after the backend's token must fit inside what the client saw around that hold:
to_backend + HOLD + to_client <= the client's time to its first byte (the `sent` stamp precedes
the backend's receipt, `first_token` follows its send). Before, neither event existed and the log
line had no such field."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tokenpath.api.app import create_app
from tokenpath.engine.embedding import EmbeddingTokenizer, default_embedding_model_dir
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.telemetry.timeline import Timeline

HOLD_S = 0.15


def backend() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()

        async def stream():  # noqa: ANN202
            await asyncio.sleep(HOLD_S)
            n = body["max_tokens"]
            for i in range(n):
                choice = {"index": 0, "text": f"w{i} ", "finish_reason": "length" if i == n - 1 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                await asyncio.sleep(0.01)
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 3, 'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextlib.asynccontextmanager
async def on_loopback(app: FastAPI):  # noqa: ANN201
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def lines(caplog) -> list[logging.LogRecord]:  # noqa: ANN001
    return [r for r in caplog.records if r.name == "tokenpath.request"]


async def test_the_log_line_says_the_gateways_own_time_before_the_backend_and_to_the_client(caplog):
    caplog.set_level(logging.INFO, logger="tokenpath.request")
    async with on_loopback(backend()) as backend_url:
        replica = RemoteReplica("url0", RemoteReplicaConfig(url=backend_url, max_num_seqs=4), model="m")
        await replica.start()
        tok = EmbeddingTokenizer(default_embedding_model_dir() / "tokenizer.json")
        dep = Deployment(name="m", task="completion", replicas=[replica], tokenizer=tok, max_model_len=512)
        try:
            async with on_loopback(create_app(ModelRouter([dep]))) as url, httpx.AsyncClient(base_url=url) as client:
                body = {"model": "m", "prompt": "hello", "max_tokens": 3, "stream": True}
                t0 = time.monotonic()
                first = None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for chunk in r.aiter_bytes():
                        if first is None and b'"w0 "' in chunk:
                            first = time.monotonic() - t0
                assert r.status_code == 200 and first is not None
                t0 = time.monotonic()
                whole = await client.post("/v1/completions", json={**body, "stream": False})
                whole_s = time.monotonic() - t0
                assert whole.status_code == 200
                await asyncio.sleep(0.1)  # (a whole reply's line follows its body)
        finally:
            await replica.close()
    streamed_line, whole_line = lines(caplog)[-2:]
    for line, seen_s in ((streamed_line, first), (whole_line, whole_s)):
        own = line.gateway_path_ms  # type: ignore[attr-defined]
        assert set(own) == {"to_backend", "to_client"}
        assert own["to_backend"] > 0 and own["to_client"] > 0
        # The two stretches are the gateway's alone: with the backend's hold between them they
        # fit in what the client waited for the byte they bound.
        assert own["to_backend"] + HOLD_S * 1000 + own["to_client"] <= seen_s * 1000 + 1.0, (own, seen_s)
    # A whole reply's first byte is its body: its `to_client` runs from the last token, not the
    # first (the tokens' 10 ms gaps are the backend's, not the gateway's).
    assert whole_line.gateway_path_ms["to_client"] < 20  # type: ignore[attr-defined]


def test_own_path_reads_sent_and_first_sent():
    tl = Timeline("r")
    t = tl.stamps["received"]
    assert tl.own_path() is None
    tl.stamp("dispatched", at=t + 0.001)
    tl.stamp("sent", at=t + 0.002)
    tl.stamp("first_token", at=t + 0.050)
    assert tl.own_path() is None  # (nothing sent to the client yet)
    tl.stamp("first_sent", at=t + 0.0505)
    tl.stamp("finished", at=t + 0.090)
    assert tl.own_path() == {"to_backend": 2.0, "to_client": 0.5}
    # A whole reply: its body (first byte) goes after the last token, and is timed from it.
    whole = Timeline("w")
    t = whole.stamps["received"]
    for name, at in (("sent", 0.003), ("first_token", 0.05), ("finished", 0.09), ("first_sent", 0.0912)):
        whole.stamp(name, at=t + at)
    assert whole.own_path() == {"to_backend": 3.0, "to_client": 1.2}
    # No stage moves: the two events bound none.
    assert set(whole.durations()) == {"prefill", "decode", "total"}
