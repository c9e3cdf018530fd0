"""`GET /dashboard`: a live page of where requests are spending their time (no build step).

The page (`static/dashboard.html`, plain HTML + JS) polls `GET /dashboard/data` twice a second:
requests in flight and the stage each is in, waterfalls of recent requests, per-stage p50/p99
over the last minutes, queue depth per priority band, KV usage and tok/s per replica.

When API keys exist, both need an admin key (the same rule as /metrics: a `serve --api-key` key or
one made with `tokenpath keys create --admin`), as `Authorization: Bearer` or, for a browser, the
`tokenpath_admin` cookie the page's own key form sets. Without keys the server is loopback-only,
and so is this.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import json
import logging
import re
import time
from dataclasses import asdict
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenpath.api.state import AppState, get_state
from tokenpath.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from tokenpath.gateway.cli import parse_time
from tokenpath.telemetry.diagnose import diagnose, engine_figures
from tokenpath.telemetry.timeline import PATH_STAGES
from tokenpath.telemetry.waterfall import summary

router = APIRouter()
COOKIE = "tokenpath_admin"
log = logging.getLogger("tokenpath.api")


def _page(name: str) -> str:
    """A static page, with the stage table filled in (defined once: `telemetry.timeline`)."""
    text = resources.files("tokenpath.api").joinpath("static", name).read_text(encoding="utf-8")
    return text.replace("__PATH_STAGES__", json.dumps(list(PATH_STAGES)))


def _script_hashes(*pages: str) -> str:
    """CSP hashes of the pages' inline scripts: they run, and no injected script does."""
    found = (m.group(1) for page in pages for m in re.finditer(r"<script>(.*?)</script>", _page(page), re.S))
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in found)


def page_headers(path: str) -> dict[str, str]:
    """`/dashboard`'s security headers: never framed (clickjacking), scripts only its own, fetches
    only to this server."""
    return {"x-frame-options": "DENY", "x-content-type-options": "nosniff",
            "content-security-policy": _csp()}


@functools.cache
def _csp() -> str:
    return (f"default-src 'none'; script-src {_script_hashes('dashboard.html', 'dashboard_login.html')}; "
            "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
            "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


async def _require_admin(state: AppState, request: Request) -> None:
    """Raise 401/403 unless auth is off or the caller holds an admin key (see `routes.require_admin`)."""
    if not state.guard.auth_enabled:
        return
    headers = dict(request.headers)
    cookie = request.cookies.get(COOKIE)
    if "authorization" not in headers and cookie:
        headers["authorization"] = f"Bearer {cookie}"
    principal = await state.guard.authenticate(headers)
    if not principal.admin:
        raise PermissionDeniedError("the dashboard needs an admin key: a `serve --api-key` key or one made with "
                                    "`tokenpath keys create --admin`", code="admin_key_required")


@router.get("/dashboard", include_in_schema=False)
async def dashboard(request: Request, state: AppState = Depends(get_state)) -> Response:
    try:
        await _require_admin(state, request)
    except (AuthenticationError, PermissionDeniedError) as exc:
        return HTMLResponse(_page("dashboard_login.html"), status_code=exc.status_code)
    return HTMLResponse(_page("dashboard.html"), headers={"cache-control": "no-store"})


@router.get("/dashboard/data", include_in_schema=False)
async def dashboard_data(request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    await _require_admin(state, request)
    return JSONResponse(state.live.snapshot(state.deployments()), headers={"cache-control": "no-store"})


@router.get("/diagnose", include_in_schema=False)
async def diagnose_window(request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    """`tokenpath diagnose --url`: the findings over the audit rows since `since` (epoch seconds or a
    duration like 10m; default 10m), for `model` if given, with this server's engine figures."""
    await _require_admin(state, request)
    raw = request.query_params.get("since", "10m")
    try:
        since = parse_time(raw)
    except argparse.ArgumentTypeError:
        try:
            since = float(raw)
        except ValueError:
            raise InvalidRequestError(f"since must be epoch seconds, an ISO time or a duration like 10m, got {raw!r}",
                                      param="since") from None
    model = request.query_params.get("model")
    store = getattr(state.guard, "store", None)
    records = await asyncio.to_thread(store.query_audit, since=since, limit=None) if store is not None else []
    rows = [summary(asdict(r)) for r in records]
    if model:
        rows = [r for r in rows if r.get("model") == model]
    deployments = [d for d in state.deployments() if not model or d.name == model]
    now = time.time()
    engines = state.engine_history.window(since, now, engine_figures(deployments, max(1e-9, now - state.started)))
    findings = diagnose(rows, engines)
    return JSONResponse({"since": since, "model": model, "requests": len(rows),
                         "engines": [{**asdict(e), "figures": e.summary()} for e in engines],
                         "findings": [f.as_dict() for f in findings]}, headers={"cache-control": "no-store"})


async def sample_engines(state: AppState) -> None:
    """Every replica's cumulative engine figures every `sample_s`, for /diagnose's windows
    (`telemetry.engine_window`): a few list copies per replica, off the request path."""
    history = state.engine_history
    failed = False
    while state.config.causes:
        await asyncio.sleep(history.sample_s)
        try:
            now = time.time()
            history.add(now, engine_figures(state.deployments(), max(1e-9, now - state.started)))
            failed = False
        except Exception:
            if not failed:  # (once per run of failures: a replica mid-restart, say)
                log.exception("sampling the engines' figures for /diagnose failed")
            failed = True
