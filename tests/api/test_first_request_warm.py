"""The first HTTP request after start-up does no more work than the next ones (issue 38's cold start).

FastAPI builds its routes' matching contexts on the first request that reaches its router, and
Starlette's request path imports anyio's streams lazily: a server's first request measured 30 ms
in the gateway against 1.8 ms for the next, and a cold catalog load's `model_load` stage carried
it. The app's lifespan now pays both before serving (`api/app.py` `_warm_request_path`).
In-process, through the whole ASGI app, the Python function calls of the first chat request are
counted (a count, not a clock: the same on a loaded machine) against the second's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable

import httpx
import pytest

from tokenpath.api.app import create_app
from tokenpath.routing.models import ModelRouter

BODY = {"model": "absent", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8}


async def _calls(send: Callable[[], Awaitable[httpx.Response]]) -> tuple[int, httpx.Response]:
    count = 0

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        response = await send()
    finally:
        sys.setprofile(None)
    return count, response


@pytest.mark.asyncio
async def test_the_first_request_after_start_up_costs_what_the_next_one_does():
    app = create_app(ModelRouter([]))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    async with app.router.lifespan_context(app), client as c:
        first, r1 = await _calls(lambda: c.post("/v1/chat/completions", json=BODY))
        second, r2 = await _calls(lambda: c.post("/v1/chat/completions", json=BODY))
    assert r1.status_code == r2.status_code == 404, r1.text  # (an unknown model: the gateway's whole path)
    # Measured: 8,449 calls for the first request with nothing warmed, 1,814 with the warm-up
    # (httpx's own first use is part of it), 1,222 for the second.
    assert first <= 2 * second, (first, second)


def test_the_warm_up_request_reaches_the_app_without_httpx():
    """The warm-up GET goes through the whole app (status 200 from /health), and building the
    command line and the app imports no httpx (issue 42: its CLI's rich and pygments came with it,
    ~4 MiB of a server's RSS beside what uvicorn shares). Before: app.py and `bench`'s parser
    imported it at module level."""
    import subprocess

    code = ("import asyncio, sys\n"
            "from tokenpath.cli import build_parser\n"
            "build_parser()\n"
            "from tokenpath.api.app import asgi_get, create_app\n"
            "from tokenpath.routing.models import ModelRouter\n"
            "print(asyncio.run(asgi_get(create_app(ModelRouter([])), '/health')), 'httpx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split() == ["200", "False"], out.stderr[-2000:]
