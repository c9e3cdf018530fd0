"""The generation endpoints' fast path (api/fast_routes.py): a well-formed JSON body is parsed and
validated once, past FastAPI's request machinery; everything else is FastAPI's route's to answer,
exactly as without the fast path."""

from __future__ import annotations

import httpx
import pytest

from tokenpath.api import fast_routes
from tokenpath.api.app import create_app
from tokenpath.routing.models import ModelRouter


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each request to a generation endpoint took the fast path."""
    seen: list[bool] = []
    parse = fast_routes._parse

    def spy(model, content_type, raw):  # noqa: ANN001, ANN202
        out = parse(model, content_type, raw)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(fast_routes, "_parse", spy)
    return seen


async def post(path: str, **kwargs: object) -> httpx.Response:
    app = create_app(ModelRouter([]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        return await client.post(path, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_a_well_formed_body_takes_the_fast_path_to_the_same_handler(taken, path, body):
    r = await post(path, json=body)
    assert taken == [True]
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # (the handler's own answer)
    assert r.headers["x-request-id"].startswith("cmpl-" if path == "/v1/completions" else "chatcmpl-")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json": {"model": "nope", "prompt": "hi", "bogus": 1}}, "unrecognized request argument supplied: bogus"),
    ({"json": ["not", "an", "object"]}, ""),
    ({"content": b"{bad json", "headers": {"content-type": "application/json"}}, "not valid JSON"),
    ({"content": b'{"model": "nope", "prompt": "hi"}', "headers": {"content-type": "text/plain"}}, "Content-Type"),
    ({"content": b"", "headers": {"content-type": "application/json"}}, ""),
])
async def test_anything_else_is_answered_by_fastapis_route_as_before(taken, kwargs, message):
    r = await post("/v1/completions", **kwargs)
    assert taken == [False]
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert r.headers.get("x-request-id", "").startswith("cmpl-")  # (recorded as a refused request, as before)


def test_the_openapi_document_still_lists_each_endpoint_once():
    paths = create_app(ModelRouter([])).openapi()["paths"]
    assert set(paths["/v1/completions"]) == {"post"} and set(paths["/v1/chat/completions"]) == {"post"}


async def test_the_fast_path_answers_before_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """A well-formed body reaches the handler without Starlette's router having matched a route
    (no `endpoint` in its scope): its match and the route's wrappers are skipped (issue 37); the
    body limit still ran first (the upload is stamped). Another method on the path is the router's."""
    from tokenpath.api import generation
    from tokenpath.api.limits import UPLOAD_KEY

    scopes: list[dict] = []
    handle = generation.handle

    async def spy(state, request, body, edge=None):  # noqa: ANN001, ANN202
        scopes.append(dict(request.scope))
        return await handle(state, request, body, edge)

    monkeypatch.setattr(generation, "handle", spy)
    r = await post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(scopes) == 1 and "endpoint" not in scopes[0] and UPLOAD_KEY in scopes[0]
    app = create_app(ModelRouter([]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        assert (await client.get("/v1/completions")).status_code == 405


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    """A body over OFF_LOOP_BYTES (a 3.5 MB schema pattern took ~20 ms to parse and validate) is
    parsed on a thread, so the loop goes on sending every stream's tokens; a small one on the loop.
    Before: every body on the loop (issue 41: one gap per such request in each concurrent stream)."""
    import threading

    threads: list[bool] = []
    parse = fast_routes._parse

    def spy(model, content_type, raw):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread() is threading.main_thread())
        return parse(model, content_type, raw)

    monkeypatch.setattr(fast_routes, "_parse", spy)
    small = {"model": "nope", "prompt": "hi", "max_tokens": 4}
    large = {**small, "prompt": "x" * (2 * fast_routes.OFF_LOOP_BYTES)}
    for body in (small, large):
        r = await post("/v1/completions", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert threads == [True, False]
