"""A request's bad value is the request's fault: a 400 naming it, never an ejected engine (issue 41).

An adversarial probe found that `stop_token_ids: [2**64]` or an `x-priority: 2**64` header made
the engine link's codec raise `OverflowError` for that one request, which the gateway took for the
replica's fault: 19 such requests ejected both engines of `--replicas 2`, and a well-behaved client
beside them got 29 of 35 requests refused with 503 `no_healthy_replica`.

Here a real `tokenpath serve --replicas 2` (two engine processes on the link) takes every known
crash value, each a 4xx in OpenAI's shape naming its field, while a well-behaved client streams
beside them: none of its requests fails, no replica is ejected, retried or restarted, and the
engines answer the same greedy tokens after as before.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import CHAT_MODEL, Server, running_server

pytestmark = pytest.mark.slow

BIG = 2**64  # one past what msgpack (the engine link's codec) carries
HUGE = 10**30


def _chat(**extra: object) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def _completion(**extra: object) -> dict:
    return {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 4, **extra}


# (path, body, headers, the field the error must name)
CASES: list[tuple[str, dict, dict[str, str], str]] = [
    ("/v1/chat/completions", _chat(stop_token_ids=[BIG]), {}, "stop_token_ids"),
    ("/v1/chat/completions", _chat(stop_token_ids=[2**63]), {}, "stop_token_ids"),
    ("/v1/chat/completions", _chat(stop_token_ids=[2**31]), {}, "stop_token_ids"),
    ("/v1/chat/completions", _chat(stop_token_ids=[-BIG]), {}, "stop_token_ids"),
    ("/v1/completions", _completion(stop_token_ids=[BIG]), {}, "stop_token_ids"),
    ("/v1/chat/completions", _chat(), {"x-priority": str(BIG)}, "x-priority"),
    ("/v1/chat/completions", _chat(), {"x-priority": str(-BIG)}, "x-priority"),
    ("/v1/chat/completions", _chat(), {"x-priority": str(HUGE)}, "x-priority"),
    ("/v1/chat/completions", _chat(seed=BIG), {}, "seed"),
    ("/v1/chat/completions", _chat(seed=-BIG), {}, "seed"),
    ("/v1/chat/completions", _chat(top_k=BIG), {}, "top_k"),
    ("/v1/chat/completions", _chat(n=BIG), {}, "n"),
    ("/v1/chat/completions", _chat(max_tokens=BIG), {}, "max_tokens"),
    ("/v1/chat/completions", _chat(max_completion_tokens=BIG), {}, "max_tokens"),  # (its other name)
    ("/v1/chat/completions", _chat(min_tokens=BIG), {}, "min_tokens"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=BIG), {}, "top_logprobs"),
    ("/v1/chat/completions", _chat(logit_bias={str(BIG): 1}), {}, "logit_bias"),
    ("/v1/chat/completions", _chat(temperature=1e308), {}, "temperature"),
    ("/v1/chat/completions", _chat(timeout=1e308), {}, "timeout"),
    ("/v1/completions", _completion(prompt=[BIG]), {}, "prompt"),
    ("/v1/completions", _completion(prompt=[[1, 2, BIG]]), {}, "prompt"),
    ("/v1/completions", _completion(logprobs=BIG), {}, "logprobs"),
    ("/v1/completions", _completion(prompt_logprobs=BIG), {}, "prompt_logprobs"),
    ("/v1/completions", _completion(best_of=BIG), {}, "best_of"),
    ("/v1/completions", _completion(min_tokens=BIG, max_tokens=None), {}, "min_tokens"),
]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("request-faults"), "--model", CHAT_MODEL,
                        "--replicas", "2", "--num-kv-blocks", "256", wait=600) as srv:
        yield srv


def _counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^tokenpath:{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M))


def _greedy(srv: Server) -> str:
    r = httpx.post(srv.base_url + "/chat/completions", timeout=120,
                   json=_chat(max_tokens=12, temperature=0) | {"messages": [{"role": "user", "content": "Name a color."}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_bad_values_are_400s_and_eject_nothing(two_engines: Server):
    srv = two_engines
    before_text = _greedy(srv)
    before = httpx.get(srv.url + "/metrics").text

    # A well-behaved client beside the adversary, all along.
    outcomes: list[int] = []
    stop = threading.Event()

    def well_behaved() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                with client.stream("POST", srv.base_url + "/chat/completions",
                                   json=_chat(max_tokens=8, stream=True)) as r:
                    body = r.read().decode()
                    outcomes.append(r.status_code if "[DONE]" in body and '"error"' not in body else 599)

    neighbour = threading.Thread(target=well_behaved)
    neighbour.start()
    failures = []
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            for _ in range(2):  # twice: an ejection after the first round would show in the second
                for path, body, headers, field in CASES:
                    r = client.post(path, json=body, headers=headers)
                    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
                        "application/json") else {}
                    named = field in (err.get("param") or "") or field in (err.get("message") or "")
                    if not (400 <= r.status_code < 500 and named):
                        failures.append(f"{path} {field}={body.get(field, headers.get(field))!r}: {r.status_code} {r.text[:200]}")
    finally:
        stop.set()
        neighbour.join(timeout=180)
    assert not failures, "\n".join(failures)
    assert outcomes and outcomes.count(200) == len(outcomes), outcomes

    after = httpx.get(srv.url + "/metrics").text
    for name in ("replica_ejections", "replica_restarts", "replica_retries"):
        assert _counter(after, name) == _counter(before, name), name
    assert httpx.get(srv.url + "/health").status_code == 200
    assert _greedy(srv) == before_text
