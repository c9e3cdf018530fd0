"""The HTTP surface: OpenAI-compatible /v1 routes, /health, and the operator endpoints /metrics and
/reset_prefix_cache (an admin key when auth is on, as vLLM puts its dev endpoints behind its key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import generation
from tokenpath.api.embeddings import handle_embeddings
from tokenpath.api.errors import OpenApiResponses
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenpath.api.state import AppState, get_state
from tokenpath.errors import InvalidRequestError, NotFoundError, PermissionDeniedError, TokenpathError
from tokenpath.protocol.names import MODEL, check_name
from tokenpath.routing.catalog import ModelCatalog
from tokenpath.telemetry.metrics import CONTENT_TYPE

router = APIRouter()
_ERRORS: OpenApiResponses = {400: {"description": "Invalid request (OpenAI error body)"},
                             404: {"description": "Unknown model"}, 413: {"description": "Body too large"}}


@router.post("/v1/chat/completions", responses=_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: AppState = Depends(get_state)) -> Response:
    return await generation.handle(state, request, body)


@router.post("/v1/completions", responses=_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    return await generation.handle(state, request, body)


@router.post("/v1/embeddings", responses=_ERRORS)
async def embeddings(body: EmbeddingRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    return await handle_embeddings(state, request, body)


def _model_card(state: AppState, name: str, paths: bool) -> dict:
    """vLLM's ModelCard: one entry per name a client may send, an alias (`--served-model-name`)
    included, each keeping the name asked for as `id`; `root` is the model that serves it and
    `parent` is null, except for a LoRA adapter (as in vLLM): `root` its path, `parent` the base.
    The path is the server's filesystem: only an operator (`paths`: an admin key, or auth off)
    sees it; a tenant's key sees the adapter's name there."""
    ref = state.router.adapter(name)
    target = state.router.aliases.get(name, name)
    catalog = state.router.catalog
    if ref is None and target not in state.router.deployments and catalog is not None and target in catalog:
        return _catalog_card(state, catalog, name, target)  # a catalog model not loaded now
    if ref is not None:
        dep = state.router.deployments[ref.base]
        root, parent = (ref.path if paths else ref.name), ref.base
    else:
        dep = state.router.resolve(name, state.router.deployments[target].task)
        root, parent = dep.name, None
    card = {"id": name, "object": "model", "created": state.started, "owned_by": dep.owned_by,
            "root": root, "parent": parent, "max_model_len": dep.max_model_len, "permission": [_permission(state, dep.name)],
            "task": dep.task}
    if catalog is not None and dep.name in catalog:
        card.update(catalog.describe(dep.name))
    elif catalog is not None:
        card["state"] = "loaded"  # (a LoRA adapter's base, or a deployment from outside the catalog)
    return card


def _permission(state: AppState, model: str) -> dict:
    return {"id": f"modelperm-{model}", "object": "model_permission", "created": state.started,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


def _catalog_card(state: AppState, catalog: ModelCatalog, name: str, target: str) -> dict:
    """The card of a catalog model not loaded now: what a loaded one shows, and its `state`
    (`unloaded`, `loading` or `failed`, with why); its context length is known once it loads."""
    entry = catalog.entry(target)
    return {"id": name, "object": "model", "created": state.started, "owned_by": "tokenpath", "root": target,
            "parent": None, "max_model_len": None, "permission": [_permission(state, target)], "task": entry.task,
            **catalog.describe(target)}


async def _visible(state: AppState, request: Request) -> tuple[list[str], bool]:
    """The names this caller may use, and whether it may see server paths (an operator)."""
    principal = await state.guard.authenticate(request.headers)
    names = state.router.names() + list(state.router.aliases) + list(state.router.adapters)
    return state.guard.visible_models(principal, names), principal.admin or not state.guard.auth_enabled


@router.get("/v1/models")
async def list_models(request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    names, paths = await _visible(state, request)
    return JSONResponse({"object": "list", "data": [_model_card(state, n, paths) for n in names]})


@router.get("/v1/models/{model_id:path}", responses={404: {"description": "Unknown model"}})
async def get_model(model_id: str, request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    check_name(model_id, MODEL, "model")
    names, paths = await _visible(state, request)
    if model_id not in names:
        raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(state, model_id, paths))


@router.post("/v1/models/{model_id:path}/load", responses={404: {"description": "Not a catalog model"}})
async def load_model(model_id: str, request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    """Load a catalog model now (operators, warm-up scripts): answers once it is loaded, or with
    the load's error (503 + Retry-After). Admin only when auth is on."""
    catalog = await _catalog_of(state, request, model_id, "load")
    return JSONResponse({"id": model_id, "object": "model", "state": await catalog.load(model_id)})


@router.post("/v1/models/{model_id:path}/unload", responses={404: {"description": "Not a catalog model"},
                                                              409: {"description": "Requests in flight"}})
async def unload_model(model_id: str, request: Request, force: bool = False,
                       state: AppState = Depends(get_state)) -> JSONResponse:
    """Unload a catalog model and free its memory; one with requests in flight is a 409 unless
    `?force=true` (they then end with a 503). Admin only when auth is on."""
    catalog = await _catalog_of(state, request, model_id, "unload")
    return JSONResponse({"id": model_id, "object": "model", "state": await catalog.unload(model_id, force=force)})


def _sleep_catalog(state: AppState):  # noqa: ANN202
    catalog = state.router.catalog
    if catalog is None:
        raise NotFoundError("sleep mode needs a model catalog (serve --models-dir, or a routing file entry with "
                            "load: on_demand): the models named at start-up stay loaded", code="no_model_catalog")
    return catalog


@router.post("/sleep", responses={404: {"description": "No model catalog"}, 409: {"description": "Requests in flight"}})
async def sleep(request: Request, level: int = 1, model: str | None = None, force: bool = False,
                state: AppState = Depends(get_state)) -> JSONResponse:
    """vLLM's sleep mode: free the memory of every loaded catalog model (or `?model=`) without a
    restart; `/wake_up` loads them again, and so does their next request. Levels 1 and 2 both free
    weights and KV cache here (the weights' file stays in the OS page cache, so waking is a quick
    reload). A model with requests in flight is a 409 unless `?force=true`. Admin only when auth
    is on."""
    await require_admin(state, request, "/sleep")
    if level not in (1, 2):
        raise InvalidRequestError(f"level is {level}; sleep levels are 1 and 2", param="level")
    if model is not None:
        check_name(model, MODEL, "model")
    catalog = _sleep_catalog(state)
    if model is not None and model not in catalog:
        raise NotFoundError(f"The model '{model}' is not in the model catalog", param="model",
                            code="model_not_found")
    return JSONResponse({"status": "ok", "sleeping": await catalog.sleep(model, force=force)})


WAKE_TAGS = ("weights", "kv_cache")


@router.post("/wake_up", responses={404: {"description": "No model catalog"}})
async def wake_up(request: Request, tags: list[str] | None = Query(None),
                  state: AppState = Depends(get_state)) -> JSONResponse:
    """vLLM's `/wake_up`: load what `/sleep` freed, and answer once loaded. vLLM's `tags` (wake
    the weights or the KV cache alone) are accepted by name; a model here wakes whole, since an
    engine without its KV cache could serve nothing."""
    await require_admin(state, request, "/wake_up")
    unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
    if unknown:
        raise InvalidRequestError(f"unknown tag(s) {', '.join(unknown)}: tags are {', '.join(WAKE_TAGS)}",
                                  param="tags")
    return JSONResponse({"status": "ok", "woken": await _sleep_catalog(state).wake_up()})


@router.get("/is_sleeping")
async def is_sleeping(request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    """vLLM's `/is_sleeping`: whether any model put to sleep is still unloaded (and which)."""
    await require_admin(state, request, "/is_sleeping")
    catalog = state.router.catalog
    asleep = catalog.sleeping() if catalog is not None else []
    return JSONResponse({"is_sleeping": bool(asleep), "models": asleep})


async def _catalog_of(state: AppState, request: Request, model_id: str, verb: str):  # noqa: ANN202
    await require_admin(state, request, f"/v1/models/{{id}}/{verb}")
    check_name(model_id, MODEL, "model")
    catalog = state.router.catalog
    if catalog is None or model_id not in catalog:
        raise NotFoundError(f"The model '{model_id}' is not in the model catalog (serve --models-dir), so it "
                            f"cannot be {verb}ed", param="model", code="model_not_found")
    return catalog


@router.get("/health")
async def health(state: AppState = Depends(get_state)) -> JSONResponse:
    """What a load balancer or a k8s probe asks: can this server answer every model it serves?

    200 while each model has at least one healthy replica: `status` is `ok` when all are healthy,
    `degraded` when some are down (the others serve; the router already steers around them).
    503 (`unhealthy`) only when some model has no healthy replica left, naming it. Each replica's
    state and, when down, why (a dead process or step loop, a failed encoder) is in the body.
    Read from each replica's own report (the engine link pushes it every 100 ms), so it is
    current within a second of an engine dying or coming back.
    `degraded` too while the audit log's store cannot be written (`audit.reason` says why; the rows
    are spooled in memory and written once it is back), within a second of the failure."""
    models: dict[str, bool] = {}
    replicas: dict[str, dict[str, dict]] = {}
    degraded = False
    for dep in state.deployments():
        own = dep.replica_states()
        replicas[dep.name] = {s.name: {"healthy": s.healthy, "state": "healthy" if s.healthy else "down",
                                       **({"detail": s.detail} if s.detail else {})} for s in own}
        models[dep.name] = any(s.healthy for s in own)
        degraded = degraded or not all(s.healthy for s in own)
    ok = all(models.values())
    body: dict = {"models": models, "replicas": replicas}
    audit = state.guard.audit_health()
    if audit is not None:
        body["audit"] = {"state": "degraded" if audit.degraded else "ok", "spool_rows": audit.spool_rows,
                         "dropped_rows": audit.dropped_total, **({"reason": audit.reason} if audit.reason else {})}
        degraded = degraded or audit.degraded
    status = "unhealthy" if not ok else "degraded" if degraded else "ok"
    return JSONResponse({"status": status, **body}, status_code=200 if ok else 503)


async def ping(state: AppState = Depends(get_state)) -> Response:
    """vLLM's liveness probe (and SageMaker's): /health's status code (200 while every model can
    answer, 503 when one cannot), with no body."""
    return Response(status_code=(await health(state)).status_code)


# One route per method, each with its own operation id: one route for both gave the OpenAPI
# document two operations with one id (FastAPI warned at every start, and clients generated
# from the document could not tell them apart).
router.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
router.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")


@router.get("/load")
async def load(state: AppState = Depends(get_state)) -> JSONResponse:
    """vLLM's `GET /load`: `server_load`, the requests this server holds now (every endpoint, from
    headers in to the last byte out), which vLLM's own routers and scalers poll."""
    return JSONResponse({"server_load": len(state.live.inflight)})


async def require_admin(state: AppState, request: Request, endpoint: str) -> None:
    """With auth on, operator endpoints need an admin key: `serve --api-key` keys, or stored keys made
    with `tokenpath keys create --admin`. With auth off (loopback only) they are open."""
    if not state.guard.auth_enabled:
        return
    principal = await state.guard.authenticate(request.headers)
    if not principal.admin:
        raise PermissionDeniedError(
            f"{endpoint} needs an admin key: a `serve --api-key` key or one made with `tokenpath keys create "
            "--admin`" + (" (serve runs with --metrics-require-key)" if endpoint == "/metrics" else ""),
            param="Authorization", code="admin_key_required")


async def _is_admin(state: AppState, request: Request) -> bool:
    """Whether the caller may see operator-only data; a missing or bad key just means no."""
    if not state.guard.auth_enabled:
        return True
    try:
        return (await state.guard.authenticate(request.headers)).admin
    except TokenpathError:
        return False


@router.get("/metrics")
async def metrics(request: Request, state: AppState = Depends(get_state)) -> Response:
    """vLLM's convention: open to scrapers. Tenant names (tenant series) need an admin key,
    unless the operator published them (`--metrics-public`); `--metrics-require-key` closes it all."""
    if state.config.metrics_require_key:
        await require_admin(state, request, "/metrics")
        tenants = True
    else:
        tenants = state.config.metrics_public or await _is_admin(state, request)
    return Response(state.metrics.render(tenants=tenants), media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    """Forget the prefix cache of every replica of every chat model (vLLM's endpoint, which aiperf's
    `--reset-kv-cache` and `tokenpath bench --reset-cache` call), so a benchmark run starts cold."""
    await require_admin(state, request, "/reset_prefix_cache")
    reset: list[str] = []
    for dep in state.deployments():
        if dep.task == "embedding":  # an encoder keeps no prefix cache
            continue
        for replica in dep.replicas:
            fn = getattr(replica, "reset_prefix_cache", None)
            if fn is not None:
                await fn()
                reset.append(replica.name)
    return JSONResponse({"status": "ok", "replicas": reset})
