"""The app factory: routes + error mapping + body/header limits around a router and a guard.

Models are loaded by the caller (`tokenpath serve`, or a test fixture), so the app can be built
around any set of deployments and starts instantly.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenpath.addresses import is_loopback
from tokenpath.api import fast_routes, structured
from tokenpath.api.anthropic.errors import reshape_for
from tokenpath.api.anthropic.routes import router as anthropic_routes
from tokenpath.api.browser import BrowserGuardMiddleware
from tokenpath.api.dashboard import page_headers, sample_engines
from tokenpath.api.dashboard import router as dashboard_routes
from tokenpath.api.errors import install_error_handlers
from tokenpath.api.inputs import warm_tokenizers
from tokenpath.api.limits import BodyLimitMiddleware
from tokenpath.api.lora import router as lora_routes
from tokenpath.api.rerank import router as rerank_routes
from tokenpath.api.responses.handler import router as responses_routes
from tokenpath.api.routes import router as api_routes
from tokenpath.api.run import refuse_early
from tokenpath.api.settings import ApiSettings
from tokenpath.api.state import AppState
from tokenpath.api.tokenize import router as tokenize_routes
from tokenpath.errors import TokenpathError
from tokenpath.gateway.audit_metrics import AuditCollector
from tokenpath.gateway.base import OpenGuard, RequestGuard
from tokenpath.routing.models import ModelRouter
from tokenpath.telemetry.metrics import ServerMetrics

log = logging.getLogger("tokenpath.api")

if TYPE_CHECKING:  # (older FastAPI releases have no native telemetry, nor this type: never imported at run time)
    from fastapi.telemetry import TelemetryConfig


class _AppOptions(TypedDict, total=False):
    """The `FastAPI(...)` arguments that only some FastAPI releases take."""

    telemetry: TelemetryConfig


def create_app(
    router: ModelRouter,
    guard: RequestGuard | None = None,
    config: ApiSettings | None = None,
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
) -> FastAPI:
    config = config or ApiSettings()
    state = AppState(router=router, guard=guard or OpenGuard(), config=config,
                     metrics=ServerMetrics(lambda: router.deployments.values()),
                     on_shutdown=list(on_shutdown))
    state.metrics.registry.register(AuditCollector(state.guard.audit_health))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # What the first request of each model would pay once (its longest-token scan, the chat
        # template's compile; ~35 ms on SmolLM2), paid before serving: at c=32 the first wave of
        # requests all waited behind it (gateway stage p50 ~100 ms, warm ~20 ms).
        tokenizers = [d.tokenizer for d in router.deployments.values()]
        await asyncio.to_thread(warm_tokenizers, tokenizers)
        # Structured output's one-time costs, off the first structured request (api/structured.py).
        warm = config.grammar_warmup
        if warm:
            await asyncio.to_thread(structured.warm_grammar_caches, tokenizers)
        grammars = asyncio.create_task(structured.warm_grammars(state.grammar_workers, tokenizers if warm else []))
        await _warm_request_path(app)
        sampler = asyncio.create_task(sample_engines(state))
        yield
        for task in (sampler, grammars):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await state.close()

    # FastAPI's own HTTP spans (newer releases emit them whenever a tracer provider exists) would
    # be a second SERVER span per request: tokenpath builds its own, from the Timeline.
    native: _AppOptions = {}
    if _has_native_telemetry():
        native["telemetry"] = {"tracing": False, "operation_spans": False}
    app = FastAPI(title="tokenpath", version="0.1.0", lifespan=lifespan,
                  summary="OpenAI-compatible LLM serving that says where every millisecond went.", **native)
    app.state.tokenpath = state
    install_error_handlers(app, lambda request, error, body: refuse_early(state, request, error, body), reshape_for)
    app.include_router(api_routes)
    app.include_router(anthropic_routes)
    app.include_router(dashboard_routes)
    app.include_router(tokenize_routes)
    app.include_router(lora_routes)
    app.include_router(responses_routes)
    app.include_router(rerank_routes)
    # (FastAPI's documented way to replace the schema, though its stub declares `openapi` a method)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    fast_routes.install(app)  # (the generation endpoints' well-formed bodies past FastAPI's machinery: inside the limit)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes,
                       max_header_bytes=config.caps.max_header_bytes, body_timeout=config.body_timeout,
                       refuse=lambda request, error: _refused(state, request, error))
    # Outermost (added last): a page in a browser is refused before any body is read.
    bind = getattr(config, "host", None)  # ServerConfig's; an app built by a test is on loopback
    app.add_middleware(BrowserGuardMiddleware, guard=lambda: state.guard,
                       check_hosts=bind is None or is_loopback(bind) or bool(config.allowed_hosts),
                       allowed_hosts=config.allowed_hosts, allowed_origins=config.allowed_origins,
                       public_docs=config.public_docs, page_headers=page_headers)
    return app


async def _warm_request_path(app: FastAPI) -> None:
    """What the first HTTP request would pay once, paid before serving: FastAPI (0.16x) builds its
    routes' matching contexts on the first request that reaches its router (~11 ms for these 16
    routes here) and the request path imports ~13 modules lazily (~14 ms). The first request of a
    server measured 30 ms in the gateway against 1.8 ms for the next; a cold catalog load's
    `model_load` stage carried it (issue 38's cold start). One in-process GET /health through the
    whole app (middleware included: loopback is always an allowed Host) pays both; it reads the
    replicas' reports only, so it changes no state, records no request and reaches no engine."""
    try:
        await asgi_get(app, "/health")
    except Exception as exc:  # noqa: BLE001 - a warm-up that fails leaves the first request to pay, nothing worse
        log.warning("warming the HTTP request path failed: %s", exc)


async def asgi_get(app: FastAPI, path: str) -> int:
    """GET `path` through the ASGI app in process, as a client on loopback; its status. Not httpx's
    ASGITransport: importing httpx imports its command line's rich and pygments too (~16 MiB of the
    server's RSS, issue 42), and nothing else in a server needs it."""
    done = asyncio.Event()
    status = 0
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()  # (a disconnect only once the response is complete)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1")], "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return status


async def _refused(state: AppState, request: Request, error: TokenpathError) -> Response:
    """A body or header refused by its limits, recorded, in the shape of the API its path belongs to."""
    return reshape_for(request, await refuse_early(state, request, error))


def _has_native_telemetry() -> bool:
    return "telemetry" in inspect.signature(FastAPI.__init__).parameters


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its default 422 responses: validation errors here are 400s."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
