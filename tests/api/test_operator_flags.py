"""What a vLLM / llama-server operator reaches for, on a real `tokenpath serve`: `--api-key` (static
keys beside stored ones), `--served-model-name`, admin-only /metrics and /reset_prefix_cache, the
startup banner and the shutdown line; and rate limits charged before anything is tokenized."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import Limits
from tokenpath.gateway.store import GatewayStore

CHAT = "smollm2-135m-instruct"
MSG = [{"role": "user", "content": "Hi"}]
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


def test_version_matches_the_package():
    from importlib.metadata import version

    out = subprocess.run([TOKENPATH, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"tokenpath {version('tokenpath')}"


@pytest.fixture(scope="module")
def keyed(server_factory):
    # A data dir the server makes itself: test_store_is_private reads the mode it gave it.
    return server_factory("--model", CHAT, "--api-key", "k1", "--served-model-name", "my-alias", "my-other",
                          "--served-model-name", "gpt-4o-mini", fresh_data_dir=True)


@pytest.fixture(scope="module")
def store(keyed):
    s = GatewayStore(keyed.log.parent / "data" / "gateway.sqlite3")
    yield s
    s.close()


def _client(srv, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=key or "", max_retries=0, timeout=120)


def test_api_key_refuses_missing_and_other_keys_and_accepts_k1(keyed):
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json={"model": CHAT, "messages": MSG}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "k2").chat.completions.create(model=CHAT, messages=MSG, max_tokens=1)
    resp = _client(keyed, "k1").chat.completions.create(model=CHAT, messages=MSG, max_tokens=1)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_served_model_names_answer_in_v1_models_and_serve_requests(keyed):
    client = _client(keyed, "k1")
    assert {m.id for m in client.models.list()} == {CHAT, "my-alias", "my-other", "gpt-4o-mini"}
    resp = client.chat.completions.create(model="my-alias", messages=MSG, max_tokens=1)
    assert resp.model == CHAT
    # vLLM's card for each name (`--served-model-name a b` takes several, as vLLM's does): the id
    # the client sends, the model behind it as `root`, no `parent` (that is for LoRA adapters).
    with httpx.Client(base_url=keyed.url, timeout=60, headers={"Authorization": "Bearer k1"}) as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert http.get("/v1/models/my-other").json() == cards["my-other"]
    for name in ("my-alias", "my-other", "gpt-4o-mini", CHAT):
        card = cards[name]
        assert (card["object"], card["root"], card["parent"]) == ("model", CHAT, None)
        assert card["max_model_len"] == cards[CHAT]["max_model_len"] > 0
        assert card["permission"][0]["object"] == "model_permission"


def test_stored_keys_keep_working_beside_static_ones(keyed, store):
    secret, _ = create_key(store, "acme")
    assert _client(keyed, secret).chat.completions.create(model=CHAT, messages=MSG, max_tokens=1).choices


def test_metrics_are_open_without_tenant_names_and_reset_needs_an_admin_key(keyed, store):
    """vLLM's convention: /metrics answers a scraper without a key; tenant names (the tenant
    series) only reach admin keys. /reset_prefix_cache changes state: admin keys only."""
    plain, _ = create_key(store, "acme")
    admin, _ = create_key(store, "ops", admin=True)
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        _client(keyed, plain).chat.completions.create(model=CHAT, messages=MSG, max_tokens=1)  # a tenant's tokens
        for headers in ({}, {"Authorization": f"Bearer {plain}"}, {"Authorization": "Bearer wrong"}):
            page = http.get("/metrics", headers=headers)
            assert page.status_code == 200
            assert "tokenpath:time_to_first_token_seconds_bucket" in page.text
            assert 'tenant="' not in page.text and "acme" not in page.text
        for key in ("k1", admin):
            page = http.get("/metrics", headers={"Authorization": f"Bearer {key}"})
            assert page.status_code == 200 and 'tokenpath:tenant_tokens_total{' in page.text
            assert 'tenant="acme"' in page.text
        assert http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {plain}"}).status_code == 403
        ok = http.post("/reset_prefix_cache", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200 and ok.json()["replicas"], ok.text


def test_metrics_require_key_closes_metrics_to_all_but_admins(server_factory):
    srv = server_factory("--model", CHAT, "--api-key", "k1", "--metrics-require-key")
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert "/metrics needs an admin key" in srv.output()


def test_reset_prefix_cache_makes_the_next_request_cold(keyed):
    client = _client(keyed, "k1")
    prompt = "tokenpath reset test " * 20  # several full KV blocks
    ask = lambda: client.completions.create(model=CHAT, prompt=prompt, max_tokens=1, temperature=0)  # noqa: E731
    ask()
    assert ask().usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(keyed.url + "/reset_prefix_cache", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert ask().usage.prompt_tokens_details.cached_tokens == 0


def test_limits_are_charged_before_the_prompt_is_tokenized(keyed, store):
    """A key's token limit refuses a 1 MB prompt from a floor on its token count (bytes / the longest
    token's bytes) before any tokenizing. Main tokenized first and answered context_length_exceeded."""
    secret, _ = create_key(store, "small", limits=Limits(tpm=1000))
    with pytest.raises(openai.BadRequestError) as err:
        _client(keyed, secret).completions.create(model=CHAT, prompt="word " * 200_000, max_tokens=1)
    assert err.value.code == "rate_limit_exceeded", err.value.body


def test_store_is_private(keyed):
    data = keyed.log.parent / "data"
    assert stat.S_IMODE((data / "gateway.sqlite3").stat().st_mode) == 0o600  # main: 0644
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


def test_banner_and_shutdown_line(keyed):
    head = keyed.output()
    assert "tokenpath 0." in head and f"model: {CHAT} (chat" in head and "also as my-alias, my-other, gpt-4o-mini" in head
    assert "auth: on (1 --api-key key(s)" in head and "data dir:" in head and "/reset_prefix_cache" in head
    assert "k1" not in head  # a key is never printed
    assert keyed.stop() == 0
    assert "stopped: drained 0 in-flight request(s), aborted 0" in keyed.output()
    assert os.path.exists(keyed.log)
