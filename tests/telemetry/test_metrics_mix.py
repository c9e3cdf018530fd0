"""After a scripted mix of 200, 400, 401, 403, 429 and a client disconnect, `/metrics` counts
exactly that mix: requests by status and error code, and rejections by reason."""

from __future__ import annotations

import re
import time

import httpx

from tests.telemetry.conftest import CHAT_MODEL, Served, chat


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for m in re.finditer(rf"^tokenpath:{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
        out[labels] = float(m.group(2))
    return out


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _label(labels: tuple, name: str) -> str:
    return dict(labels)[name]


def test_status_and_rejection_counters_equal_the_mix(served: Served, http: httpx.Client):
    before = http.get("/metrics", headers=served.headers("admin")).text
    assert http.post("/v1/chat/completions", json=chat(2), headers=served.headers()).status_code == 200
    assert http.post("/v1/chat/completions", json=chat(2), headers=served.headers("limited_mix")).status_code == 200
    assert http.post("/v1/chat/completions", json=chat(2), headers=served.headers("limited_mix")).status_code == 429
    assert http.post("/v1/chat/completions", json=chat(2, n=0), headers=served.headers()).status_code == 400
    assert http.post("/v1/chat/completions", json=chat(2), headers={"authorization": "Bearer x"}).status_code == 401
    assert http.post("/v1/chat/completions", json=chat(2), headers=served.headers("other")).status_code == 403
    with http.stream("POST", "/v1/chat/completions", headers=served.headers(),
                     json=chat(400, stream=True, ignore_eos=True)) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # one chunk, then leave
    expected_status = {"200": 2, "429": 1, "400": 1, "401": 1, "403": 1, "499": 1}
    deadline = time.monotonic() + 30
    while True:  # the disconnect is noticed by the server asynchronously
        after = http.get("/metrics", headers=served.headers("admin")).text
        got = _delta(_samples(before, "requests_total"), _samples(after, "requests_total"))
        by_status: dict[str, float] = {}
        for labels, n in got.items():
            by_status[_label(labels, "status")] = by_status.get(_label(labels, "status"), 0) + n
        if by_status == expected_status or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert by_status == expected_status
    codes = {(_label(k, "status"), _label(k, "code")): v for k, v in got.items()}
    assert codes[("429", "rate_limit_exceeded")] == 1 and codes[("401", "invalid_api_key")] == 1
    assert codes[("403", "model_not_allowed")] == 1 and codes[("499", "client_disconnected")] == 1
    rejections = _delta(_samples(before, "request_rejections_total"), _samples(after, "request_rejections_total"))
    assert {_label(k, "reason"): v for k, v in rejections.items()} == {"auth": 1, "acl": 1, "rate_limit": 1}

    # The other new series exist with vLLM-style names and count what happened.
    for name in ("request_time_per_output_token_seconds_count", "engine_step_seconds_count",
                 "iteration_tokens_total_count", "iteration_seqs_count"):
        assert _samples(after, name), name
    stages = {_label(k, "stage") for k in _samples(after, "request_stage_seconds_count")}
    assert {"gateway", "queue", "engine_queue", "prefill", "decode"} <= stages
    tenants = _delta(_samples(before, "tenant_tokens_total"), _samples(after, "tenant_tokens_total"))
    assert {(_label(k, "tenant"), _label(k, "kind")) for k in tenants} >= {("acme", "prompt"), ("acme", "generation"),
                                                                          ("limited", "generation")}
    assert all(_label(k, "model_name") == CHAT_MODEL for k in tenants)
