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
OpenAPI document, and that fallback); these are matched first.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenpath.api import generation
from tokenpath.api.limits import replay
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenpath.api.state import get_state

M = TypeVar("M", bound=BaseModel)
FAST_PATHS: tuple[tuple[str, type[ChatCompletionRequest] | type[CompletionRequest]], ...] = (
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest))


class _Delegate(Response):
    """The FastAPI route, run as this request's response: the body read here is handed to it again."""

    def __init__(self, app: ASGIApp, body: bytes) -> None:
        self.app, self.body_bytes = app, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, replay(self.body_bytes, receive), send)


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


def _endpoint(model: type[ChatCompletionRequest] | type[CompletionRequest],
              fallback: ASGIApp) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        body = _parse(model, request.headers.get("content-type"), raw)
        if body is None:
            return _Delegate(fallback, raw)
        return await generation.handle(await get_state(request), request, body)

    return endpoint


def install(app: FastAPI, router: APIRouter) -> None:
    """Put the fast path in front of the generation endpoints of `router` (already included in
    `app`): matched first; each falls back to its FastAPI route (`router`'s own `APIRoute`)."""
    for path, model in FAST_PATHS:
        api = next(r for r in router.routes if isinstance(r, APIRoute) and r.path == path
                   and "POST" in (r.methods or ()))
        app.router.routes.insert(0, Route(path, _endpoint(model, api.app), methods=["POST"], include_in_schema=False))
