"""The generation endpoints' own path past FastAPI's request machinery, for the well-formed body.

Measured (benchmarks/results/vllm_behind_gateway-loaded-ab.md): FastAPI's route handling of a
`POST /v1/completions` (its body read and content-type check, `json.loads`, validation through its
body field, dependency solving, its telemetry hooks) took ~290 us per request in-process on a
quiet core, the same request parsed and validated directly ~60 us; on the gateway's two busy cores
the step from the body read to the handler was 0.54-0.58 ms p50, all of it before the request
reaches the backend. The body is parsed once (`json.loads`, as FastAPI does) and validated once
(the same pydantic model, in the same python mode), and `generation.handle` gets it as it would
from FastAPI.

Only the plain case takes this path: a JSON content type and a body the model accepts. Anything
else (no or another content type, malformed JSON, a body the schema refuses) is handed, with its
body replayed, to the FastAPI route itself, which answers exactly as before (its validation error,
the 400 it becomes, the request's audit row and log line). The FastAPI routes stay registered (the
OpenAPI document, and that fallback); this path is an ASGI middleware inside the body limit, so the
router's own match and wrappers are skipped too (`FastGenerationMiddleware`).
"""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenpath.api import generation
from tokenpath.api.limits import replay
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenpath.api.state import get_state

M = TypeVar("M", bound=BaseModel)
# A body larger than this is parsed and validated on a thread, not on the event loop: a 3.5 MB
# schema pattern took ~20 ms (a 2,000-entry enum ~15 ms: pydantic's check of every string), all of
# it one gap in every stream the loop was sending (issue 41). A thread still takes the GIL, but
# gives it back every switch interval (5 ms), so the loop goes on. Below it, a hop (0.15-0.5 ms
# on two busy cores) would cost more than the parse.
OFF_LOOP_BYTES = 16 * 1024
FAST_PATHS: tuple[tuple[str, type[ChatCompletionRequest] | type[CompletionRequest]], ...] = (
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest))


def _is_json(content_type: str | None) -> bool:
    """`application/json` (any parameters): the one content type FastAPI parses as JSON that is
    taken here; `+json` subtypes and a missing header go to FastAPI's own reading."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def _parse(model: type[M], content_type: str | None, raw: bytes) -> M | None:
    """The validated body, or None for anything but the plain case (FastAPI answers those)."""
    if not raw or not _is_json(content_type):
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError; too deep a body)
        return None
    if not isinstance(data, dict):
        return None
    try:
        return model.model_validate(data)
    except (ValidationError, RecursionError):  # (a schema nested past the depth FastAPI's path refuses)
        return None


class FastGenerationMiddleware:
    """The generation endpoints' well-formed bodies, answered before Starlette's router: inside the
    body limit (the body is read, its upload stamped) and the browser guard, outside the exception
    middleware, the router's match and the route's own wrappers (request, exception handling, the
    exit stack), which `generation.handle` does not need: it answers every error itself. Measured
    in front of vLLM: the step from the body read to the handler was ~0.24 ms p50 as a route
    matched first (issue 37). Anything else goes on down the app, its body replayed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.paths = dict(FAST_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = self.paths.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            and not scope.get("root_path") else None
        if model is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        raw = await request.body()
        content_type = request.headers.get("content-type")
        if len(raw) > OFF_LOOP_BYTES:  # the loop sends every stream's tokens meanwhile
            body = await asyncio.to_thread(_parse, model, content_type, raw)
        else:
            body = _parse(model, content_type, raw)
        if body is None:  # FastAPI's route answers it, exactly as without this path
            await self.app(scope, replay(raw, receive), send)
            return
        response = await generation.handle(await get_state(request), request, body)
        await response(scope, receive, send)


def install(app: FastAPI) -> None:
    """Put the fast path in front of the generation endpoints (their FastAPI routes stay: the
    OpenAPI document, and the answer to any other body). Call it before the body limit is added,
    so that it runs inside it."""
    app.add_middleware(FastGenerationMiddleware)
