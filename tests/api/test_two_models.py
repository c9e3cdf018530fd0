"""`tokenpath serve --model smollm2-135m-instruct --model gemma-3-270m`: two real chat models in
one server, routed by name, each with its own engine, metrics and /v1/models entry. Gemma 3 270M
is a base model (its GGUF has no chat template), so chat on it is an OpenAI 400 naming the fix
(--chat-template), while completions work."""

from __future__ import annotations

import httpx
import pytest
from tests.api.conftest import CHAT_MODEL, read_metric, running_server

GEMMA = "gemma-3-270m"
pytestmark = pytest.mark.requires("gemma3")


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    args = ("--model", CHAT_MODEL, "--model", GEMMA, "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
    with running_server(tmp_path_factory.mktemp("two"), *args, wait=900) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as client:
        yield client


def test_both_listed(http):
    ids = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert {CHAT_MODEL, GEMMA} <= ids


def test_completions_routed_by_name(http):
    r = http.post("/v1/completions", json={"model": GEMMA, "prompt": "The capital of France is",
                                           "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == GEMMA and body["usage"]["completion_tokens"] > 0
    assert "Paris" in body["choices"][0]["text"] or "France" in body["choices"][0]["text"]
    r = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["model"] == CHAT_MODEL, r.text
    text = http.get("/metrics").text
    for model in (CHAT_MODEL, GEMMA):  # each deployment its own series
        assert read_metric(text, "num_requests_running", model) == 0


def test_chat_on_base_model_is_a_clear_400(http):
    r = http.post("/v1/chat/completions", json={"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "no chat template" in err["message"] and "--chat-template" in err["message"]
    assert err["param"] == "messages"
