"""Through a URL replica, a request keeps what it asked for: its constraint and its logprobs.

A gateway (`tokenpath serve --routing`, a `url:` replica) in front of a real OpenAI-compatible
backend, here another `tokenpath serve` (it reads vLLM's `structured_outputs` spelling, which the
replica now sends; vLLM's CPU build is the benchmark's backend, `benchmarks/`). Before: the replica's
request body had no constraint, so `structured_outputs: {choice: [...]}` came back as free text with
a 200, and `logprobs` as an empty list.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from tests.api.conftest import Server, running_server

from tokenpath.config import DEFAULT_CHAT_MODEL


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(gateway, backend)."""
    tmp = tmp_path_factory.mktemp("remote-constraints")
    with running_server(tmp / "backend", "--model", DEFAULT_CHAT_MODEL) as backend:
        routes = tmp / "routes.yaml"
        routes.write_text(f"deployments:\n  - name: {DEFAULT_CHAT_MODEL}\n    replicas:\n"
                          f"      - url: {backend.url}\n        max_num_seqs: 8\n")
        with running_server(tmp / "gateway", "--model", DEFAULT_CHAT_MODEL, "--routing", str(routes)) as gw:
            yield gw, backend


@pytest.fixture
def gateway(servers: tuple[Server, Server]) -> Server:
    return servers[0]


def chat(gw: Server, **extra) -> dict:
    body = {"model": DEFAULT_CHAT_MODEL, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about your day."}], **extra}
    r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("constraint", [
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
        "type": "object", "properties": {"mood": {"type": "string", "enum": ["good", "bad"]}},
        "required": ["mood"], "additionalProperties": False}}}},
], ids=["choice", "regex", "json_schema"])
def test_the_constraint_reaches_the_backend(gateway, constraint):
    text = chat(gateway, **constraint)["choices"][0]["message"]["content"]
    if "structured_outputs" in constraint and "choice" in constraint["structured_outputs"]:
        assert text in ("yes", "no"), text
    elif "structured_outputs" in constraint:
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    else:
        assert json.loads(text)["mood"] in ("good", "bad"), text


def test_logprobs_come_back_in_full(gateway):
    reply = chat(gateway, logprobs=True, top_logprobs=3, max_tokens=8)
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == 8
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert max(t["logprob"] for t in entry["top_logprobs"]) >= entry["logprob"] - 1e-4


def test_usage_counts_what_the_backend_generated(gateway):
    """Token ids come from the backend (`return_token_ids`), not from re-encoding its text: text
    re-encoded merges tokens at chunk boundaries, which billed 63 of vLLM's 64 tokens."""
    body = {"model": DEFAULT_CHAT_MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.9,
            "seed": 3, "ignore_eos": True}
    r = httpx.post(gateway.base_url + "/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_on_completions(servers, stream):
    """vLLM's `return_token_ids`, served by tokenpath too (what a gateway in front of it asks for)."""
    backend = servers[1]
    body = {"model": DEFAULT_CHAT_MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(backend.base_url + "/completions", json=body, timeout=300).json()
        ids = r["choices"][0]["token_ids"]
        assert len(ids) == r["usage"]["completion_tokens"] == 12
        return
    ids = []
    with httpx.stream("POST", backend.base_url + "/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice["token_ids"]
    assert len(ids) == 12 and all(isinstance(i, int) and i >= 0 for i in ids)
    bad = httpx.post(backend.base_url + "/completions", json={**body, "return_token_ids": "yes"}, timeout=60)
    assert bad.status_code == 400 and "return_token_ids" in bad.text


def test_the_backends_own_stages_split_its_time(gateway):
    """The backend (tokenpath here; vLLM's `metrics` and llama.cpp's `timings` are read the same
    way: test_backend_timing.py) reports its prefill on the final usage chunk: the gateway's
    `engine_queue` now exists (the hop and the backend's queue), and `prefill` is the backend's,
    no longer everything from dispatch to the first chunk."""
    body = {"model": DEFAULT_CHAT_MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    timing = httpx.post(gateway.base_url + "/completions", json=body, timeout=300).json()["tokenpath"]["timing"]
    assert timing["engine_queue"] > 0 and timing["prefill"] > 0, timing
    stages = [v for k, v in timing.items() if k != "total"]
    assert abs(sum(stages) - timing["total"]) < 1e-6
