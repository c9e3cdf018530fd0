"""A small, real OpenAI-style streaming server for the bench's client tests (not a mock: it runs
uvicorn on a loopback port and speaks HTTP + SSE). It makes the behaviours the client must handle
happen on purpose: role-only first chunks, usage chunks with tokenpath timing, status errors,
streams without content. The integration test against the real `tokenpath serve` lives apart.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class StubState:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # Authorization header of each request
    fail: dict[int, int] = field(default_factory=dict)  # request number (1-based) -> HTTP status
    empty: set[int] = field(default_factory=set)  # request numbers that stream no content
    timing: bool = True  # attach tokenpath timing to the usage chunk
    delay: float = 0.002  # seconds between content chunks
    short_by: int = 0  # emit this many fewer tokens than max_tokens (an EOS-like early stop)
    usage: bool = True  # honour stream_options.include_usage (some servers ignore it)
    seen: set[str] = field(default_factory=set)  # a toy prefix cache: prompts seen whole are "cached"
    resets: int = 0  # POST /reset_prefix_cache calls


def _prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


def make_app(state: StubState) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        n = len(state.bodies)
        if n in state.fail:
            return JSONResponse({"error": {"message": "nope", "type": "x", "param": None, "code": None}},
                                status_code=state.fail[n])
        tokens = 0 if n in state.empty else max(1, body["max_tokens"] - state.short_by)

        def chunk(text: str | None, **extra: Any) -> str:
            if chat:
                delta = {"role": "assistant"} if text is None else {"content": text}
                choices = [{"index": 0, "delta": delta, "finish_reason": None}]
            else:
                choices = [{"index": 0, "text": text or "", "finish_reason": None}]
            return "data: " + json.dumps({"id": f"r{n}", "choices": choices, **extra}) + "\n\n"

        async def stream():
            if chat:
                yield chunk(None)  # role-only: must not count as the first token
            for i in range(tokens):
                await asyncio.sleep(state.delay)
                yield chunk(f" w{i}")
            key = json.dumps(body.get("messages") or body.get("prompt"))
            cached = _prompt_words(body) if key in state.seen else 0
            state.seen.add(key)
            usage = {"prompt_tokens": _prompt_words(body), "completion_tokens": tokens,
                     "total_tokens": _prompt_words(body) + tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            final: dict[str, Any] = {"id": f"r{n}", "choices": [], "usage": usage}
            if state.timing:
                final["tokenpath"] = {"timing": {"gateway": 0.0005, "queue": 0.001, "engine_queue": 0.0015,
                                                "prefill": 0.002, "decode": 0.003, "total": 0.008}}
            yield ": keep-alive comment\n\n"
            if state.usage:
                yield "data: " + json.dumps(final) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        state.seen.clear()
        state.resets += 1
        return JSONResponse({"status": "ok"})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubServer:
    """uvicorn on a background thread; `url` is the /v1 base."""

    def __init__(self, state: StubState | None = None) -> None:
        self.state = state or StubState()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cfg = uvicorn.Config(make_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            threading.Event().wait(0.01)
        raise RuntimeError("stub server did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
