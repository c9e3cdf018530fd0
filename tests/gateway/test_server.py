"""The gateway in front of a real server: real SmolLM2, real HTTP (uvicorn), the real `openai` client.

One server for the module (the model takes tens of seconds to load). It runs in-process so its
gateway can use an injectable clock (for the day boundary and to freeze the rate window while
50 requests race), over a real SQLite store that the tests also open as "another process" would
(the CLI revoking a key while the server runs). Each test uses its own tenant and keys.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tokenpath.cli import main as cli_main
from tokenpath.config import DEFAULT_CHAT_MODEL
from tokenpath.gateway import Gateway, GatewayStore, Limits
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import OPEN_STATUS
from tokenpath.gateway.limiter import DAY_S, day_of

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Say hi."}]
SERVER_LOGGERS = ("tokenpath", "uvicorn", "uvicorn.error", "uvicorn.access", "fastapi", "starlette")


class ServerClock:
    """Real time, unless a test freezes it or moves it (the gateway reads it for windows and days)."""

    def __init__(self) -> None:
        self.frozen: float | None = None

    def __call__(self) -> float:
        return time.time() if self.frozen is None else self.frozen


@dataclass
class Server:
    base_url: str
    data_dir: Path
    clock: ServerClock
    logs: io.StringIO
    secrets: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # every error body and header set the clients got

    def store(self) -> GatewayStore:
        return GatewayStore(self.data_dir / "gateway.sqlite3")

    def key(self, tenant: str, **kw: object) -> str:
        store = self.store()
        try:
            secret, _ = create_key(store, tenant, **kw)
        finally:
            store.close()
        self.secrets.append(secret)
        return secret

    def client(self, secret: str | None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=secret or "none", max_retries=0, timeout=300)

    def note(self, exc: openai.APIStatusError) -> openai.APIStatusError:
        self.seen.append(exc.response.text + json.dumps(dict(exc.response.headers)))
        return exc


def _run_server(server_holder: dict, sock: socket.socket, data_dir: Path, clock: ServerClock) -> None:
    import uvicorn

    from tokenpath.api.app import create_app
    from tokenpath.routing.models import ModelRouter
    from tokenpath.server.config import ServerConfig
    from tokenpath.server.deployments import load_deployments

    async def serve() -> None:
        config = ServerConfig(models=[DEFAULT_CHAT_MODEL], data_dir=str(data_dir))
        deployments, closers = await load_deployments(config)
        guard = Gateway(GatewayStore(data_dir / "gateway.sqlite3"), clock=clock)
        app = create_app(ModelRouter(deployments, {}), guard, config, on_shutdown=closers)
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=True, lifespan="on"))
        server_holder["server"] = server
        await server.serve(sockets=[sock])

    try:
        asyncio.run(serve())
    except BaseException as exc:  # noqa: BLE001 - reported to the fixture, which fails the tests
        server_holder["error"] = exc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("gateway-server")
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    saved = {}
    for name in SERVER_LOGGERS:
        lg = logging.getLogger(name)
        saved[name] = lg.level
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    clock = ServerClock()
    srv = Server(base_url="", data_dir=data_dir, clock=clock, logs=logs)
    srv.key("setup")  # a key exists before the server starts: auth is on
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    holder: dict = {}
    thread = threading.Thread(target=_run_server, args=(holder, sock, data_dir, clock), daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while not (holder.get("server") and holder["server"].started):
        if "error" in holder or not thread.is_alive():
            pytest.fail(f"the server did not start: {holder.get('error')!r}")
        if time.monotonic() > deadline:
            pytest.fail("the server did not start within 600 s")
        time.sleep(0.2)
    srv.base_url = f"http://127.0.0.1:{port}/v1"
    yield srv
    holder["server"].should_exit = True
    thread.join(120)
    for name in SERVER_LOGGERS:
        logging.getLogger(name).removeHandler(handler)
        logging.getLogger(name).setLevel(saved[name])
    sock.close()


def audit_rows(server: Server, request_id: str, wait_s: float = 60) -> list:
    """The audit rows of a request, waiting (bounded) for the server's `finally` to close them (a row
    is opened at admission with status 0, and closed with every column when the request ends)."""
    store = server.store()
    try:
        deadline = time.monotonic() + wait_s
        while True:
            rows = store.query_audit(request_id=request_id)
            if (rows and all(r.status != OPEN_STATUS for r in rows)) or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)
    finally:
        store.close()


def test_missing_and_wrong_keys_are_401_and_audited(server: Server):
    for secret in (None, "tp-" + "x" * 43):
        with pytest.raises(openai.AuthenticationError) as err:
            server.client(secret).chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, max_tokens=2)
        server.note(err.value)
        assert err.value.status_code == 401 and "x" * 10 not in err.value.response.text
        (row,) = audit_rows(server, err.value.response.headers["x-request-id"])
        assert (row.status, row.error_type, row.key_prefix) == (401, "authentication_error", None)


def test_model_access_is_403_and_models_list_is_filtered(server: Server):
    allowed = server.key("models-t", models=frozenset({DEFAULT_CHAT_MODEL}))
    other = server.key("models-t", models=frozenset({"some-other-model"}))
    assert [m.id for m in server.client(allowed).models.list()] == [DEFAULT_CHAT_MODEL]
    assert [m.id for m in server.client(other).models.list()] == []
    with pytest.raises(openai.PermissionDeniedError) as err:
        server.client(other).chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, max_tokens=2)
    server.note(err.value)
    (row,) = audit_rows(server, err.value.response.headers["x-request-id"])
    assert (row.status, row.tenant, row.key_prefix) == (403, "models-t", other[:11])


def test_rate_limited_request_is_429_with_headers_and_every_response_has_them(server: Server):
    secret = server.key("rpm-t", limits=Limits(rpm=1, tpm=5000))
    client = server.client(secret)
    raw = client.chat.completions.with_raw_response.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES,
                                                           max_tokens=4, temperature=0)
    completion = raw.parse()
    assert completion.usage.completion_tokens >= 1
    assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert raw.headers["x-ratelimit-limit-tokens"] == "5000"
    reserved = completion.usage.prompt_tokens + 4
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(5000 - reserved)
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, max_tokens=4)
    server.note(err.value)
    h = err.value.response.headers
    assert err.value.status_code == 429 and 1 <= int(h["retry-after"]) <= 60
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert "x-ratelimit-remaining-tokens" in h and "x-ratelimit-reset-tokens" in h
    assert err.value.body["code"] == "rate_limit_exceeded"
    (row,) = audit_rows(server, h["x-request-id"])
    assert (row.status, row.error_type) == (429, "rate_limit_error")
    (ok_row,) = audit_rows(server, raw.headers["x-request-id"])
    assert (ok_row.status, ok_row.finish_reason, ok_row.completion_tokens) == (
        200, completion.choices[0].finish_reason, completion.usage.completion_tokens)


def test_revocation_takes_effect_on_the_next_request(server: Server, capsys: pytest.CaptureFixture):
    secret = server.key("revoke-t")
    client = server.client(secret)
    client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, max_tokens=1)
    assert cli_main(["keys", "revoke", secret[:11], "--data-dir", str(server.data_dir)]) == 0
    capsys.readouterr()
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, max_tokens=1)
    server.note(err.value)
    assert "revoked" in err.value.message


def test_tpm_exact_under_50_concurrent_requests(server: Server):
    secret = server.key("tpm-t", limits=Limits(tpm=1000))
    server.clock.frozen = time.time()  # one window for the whole race, however slow the machine is
    max_tokens = 16

    async def one(client: openai.AsyncOpenAI) -> object:
        try:
            return await client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES,
                                                        max_tokens=max_tokens, temperature=0)
        except openai.RateLimitError as exc:
            return server.note(exc)

    async def race() -> list[object]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=secret, max_retries=0,
                                      timeout=600) as client:
            return await asyncio.gather(*(one(client) for _ in range(50)))

    try:
        results = asyncio.run(race())
    finally:
        server.clock.frozen = None
    ok = [r for r in results if not isinstance(r, openai.RateLimitError)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    prompt = ok[0].usage.prompt_tokens
    assert 1000 // (prompt + max_tokens) <= len(ok) and refused  # the limit was the binding constraint
    # Charged in the window = reserved by in-flight + used by finished; it never exceeded 1,000,
    # so what the admitted requests used in the end cannot either.
    assert sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in ok) <= 1000
    for r in refused:
        assert r.response.headers["x-ratelimit-limit-tokens"] == "1000"
        assert int(r.response.headers["x-ratelimit-remaining-tokens"]) < prompt + max_tokens


def test_daily_quota_resets_at_the_day_boundary(server: Server):
    secret = server.key("daily-t", limits=Limits(daily_tokens=150))
    client = server.client(secret)
    full = {"max_tokens": 60, "temperature": 0, "extra_body": {"ignore_eos": True}}  # uses all 60
    server.clock.frozen = (day_of(time.time()) + 1) * DAY_S - 30  # 23:59:30 UTC
    try:
        first = client.chat.completions.with_raw_response.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, **full)
        used = first.parse().usage
        assert used.completion_tokens == 60 and 2 * (used.prompt_tokens + 60) > 150 and used.prompt_tokens + 60 <= 150
        assert first.headers["x-ratelimit-limit-tokens-day"] == "150"
        with pytest.raises(openai.RateLimitError) as err:  # a second one does not fit today
            client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, **full)
        server.note(err.value)
        assert err.value.response.headers["retry-after"] == "30"
        assert err.value.response.headers["x-ratelimit-remaining-tokens-day"] == str(150 - used.total_tokens)
        server.clock.frozen += 31  # 00:00:01, the next day
        again = client.chat.completions.with_raw_response.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES, **full)
        assert again.headers["x-ratelimit-remaining-tokens-day"] == str(150 - used.total_tokens)
    finally:
        server.clock.frozen = None


def test_failed_and_disconnected_requests_are_audited(server: Server):
    secret = server.key("audit-t")
    with pytest.raises(openai.BadRequestError) as err:  # fails after authentication
        server.client(secret).chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=MESSAGES,
                                                      max_tokens=2, temperature=-1)
    server.note(err.value)
    (row,) = audit_rows(server, err.value.response.headers["x-request-id"])
    assert (row.status, row.tenant, row.key_prefix) == (400, "audit-t", secret[:11])

    body = {"model": DEFAULT_CHAT_MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=300) as http, http.stream(
        "POST", f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # the first chunk arrived; hang up mid-generation
    (row,) = audit_rows(server, request_id)
    assert (row.status, row.error_type, row.finish_reason) == (499, "client_disconnected", "abort")
    assert row.completion_tokens < 400 and row.tenant == "audit-t"


def test_no_key_beyond_its_prefix_in_logs_audit_rows_error_bodies_or_metrics(server: Server):
    """Runs last: searches everything the module's requests left behind for every key used."""
    metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=60).text
    store = server.store()
    try:
        with store.db.transaction() as tx:
            stored = "\n".join(repr(r) for t in ("tenants", "api_keys", "admissions", "daily_usage", "audit_log")
                               for r in tx.q(f"SELECT * FROM {t}"))
    finally:
        store.close()
    haystack = "\n".join([server.logs.getvalue(), stored, metrics, *server.seen])
    assert len(server.seen) >= 8 and "uvicorn.access" in server.logs.getvalue()
    assert len(server.secrets) >= 8
    assert "Say hi." not in stored  # prompt and completion text stay out unless the operator turns it on
    for secret in server.secrets:
        assert secret[:11] in stored  # prefixes are meant to be seen
        assert secret[:12] not in haystack and secret[11:] not in haystack and secret[-10:] not in haystack
