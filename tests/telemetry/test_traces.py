"""Traces leave the process: `tokenpath serve --otlp-endpoint` to a real OTLP/HTTP receiver.

One streamed request is one trace: the SERVER root `chat {model}` with the GenAI attributes,
its gateway children, the CLIENT `dispatch` span and the engine's spans under it, every parent
link pointing at a span of the same trace. A client's `traceparent` makes the root its child;
a 400 and a 429 give an error root with `error.type`.
"""

from __future__ import annotations

import time

import httpx

from tests.telemetry.conftest import CHAT_MODEL, Served, chat

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def _root(served: Served, request_id: str) -> dict:
    spans = served.receiver.wait_for(lambda s: s["attributes"].get("gen_ai.response.id") == request_id)
    assert len(spans) == 1, f"expected one root span for {request_id}, got {spans}"
    return spans[0]


def _complete_trace(served: Served, trace_id: str, expect: int) -> list[dict]:
    served.receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "engine.decode")
    spans = served.receiver.trace(trace_id)
    assert len(spans) >= expect, [s["name"] for s in spans]
    return spans


def test_a_streamed_request_is_one_trace_with_genai_attributes(served: Served, http: httpx.Client):
    with http.stream("POST", "/v1/chat/completions", headers=served.headers(),
                     json=chat(12, stream=True, seed=7, top_p=0.9)) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        body = "".join(resp.iter_lines())
    assert "[DONE]" in body
    root = _root(served, request_id)
    spans = _complete_trace(served, root["trace_id"], 10)
    by_name = {s["name"]: s for s in spans}
    ids = {s["span_id"] for s in spans}
    # In-process, the gateway is the one owner of the engine's spans: each exactly once.
    assert sorted(s["name"] for s in spans if s["name"].startswith("engine.")) == [
        "engine.decode", "engine.prefill", "engine.queue"]

    assert root["kind"] == "SPAN_KIND_SERVER" and root["name"] == f"chat {CHAT_MODEL}"
    assert root["parent_id"] is None
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "tokenpath"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == CHAT_MODEL
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 0.9 and a["gen_ai.request.seed"] == 7
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == served.port
    assert a["tokenpath.tenant"] == "acme" and a["tokenpath.key_prefix"].startswith("tp-")
    assert a["tokenpath.replica"] and a["tokenpath.routing.policy"] and "tokenpath.routing.reason" in a
    assert "tokenpath.cached_tokens" in a and a["tokenpath.priority"] == 0
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # no text by default
    assert all(served.keys["acme"] not in repr(s["attributes"]) for s in spans)

    # Every span belongs to this trace and hangs off a span of it; the tree has the right shape.
    assert all(s["parent_id"] in ids for s in spans if s is not root)
    for name in ("gateway.auth", "gateway.route", "gateway.tokenize", "gateway.rate_limit", "admission.queue"):
        assert by_name[name]["parent_id"] == root["span_id"], name
    dispatch = next(s for s in spans if s["name"].startswith("dispatch "))
    assert dispatch["kind"] == "SPAN_KIND_CLIENT" and dispatch["parent_id"] == root["span_id"]
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        span = by_name[name]
        assert span["parent_id"] == dispatch["span_id"], name
        assert dispatch["start"] <= span["start"] <= span["end"] <= dispatch["end"], name
    assert root["start"] <= dispatch["start"] <= dispatch["end"] <= root["end"]
    prefill, decode = by_name["engine.prefill"], by_name["engine.decode"]
    assert prefill["events"] and all(e["name"] == "prefill_chunk" for e in prefill["events"])
    assert sum(e["attributes"]["tokens"] for e in prefill["events"]) == (
        a["gen_ai.usage.input_tokens"] - a["tokenpath.cached_tokens"]), prefill["events"]
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 12
    assert decode["attributes"]["tokenpath.itl.p50_ms"] > 0


def test_a_client_traceparent_is_honoured(served: Served, http: httpx.Client):
    resp = http.post("/v1/chat/completions", json=chat(4), headers=served.headers(
        traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
    assert resp.status_code == 200
    root = _root(served, resp.headers["x-request-id"])
    assert root["trace_id"] == CALLER_TRACE and root["parent_id"] == CALLER_SPAN
    # The log line carries the same trace id, so logs and traces join up.
    line = next(r for r in served.log_records() if r.get("request_id") == resp.headers["x-request-id"])
    assert line["trace_id"] == CALLER_TRACE


def test_errors_give_an_error_root_with_error_type(served: Served, http: httpx.Client):
    bad = http.post("/v1/chat/completions", json=chat(4, temperature=-1), headers=served.headers())
    assert bad.status_code == 400
    root = _root(served, bad.headers["x-request-id"])
    assert root["attributes"]["error.type"] == "invalid_request_error"
    assert root["attributes"]["http.response.status_code"] == 400 and root["status"] == 2  # STATUS_CODE_ERROR

    statuses = [http.post("/v1/chat/completions", json=chat(1), headers=served.headers("limited"))
                for _ in range(2)]
    assert [r.status_code for r in statuses] == [200, 429]
    root = _root(served, statuses[1].headers["x-request-id"])
    assert root["attributes"]["error.type"] == "rate_limit_exceeded" and root["status"] == 2


def _count(served: Served, name: str, **attrs: object) -> int:
    return sum(p["count"] for p in served.receiver.latest_points(name)
               if all(p["attributes"].get(k) == v for k, v in attrs.items()))


def test_genai_metrics_arrive_over_otlp_beside_the_traces(served: Served, http: httpx.Client):
    """One finished request is one reading of each GenAI histogram, exported to the same
    endpoint as the traces, with the conventions' names, units and buckets."""
    names = ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
             "gen_ai.server.time_per_output_token", "gen_ai.client.token.usage")
    chat_ok = {"gen_ai.operation.name": "chat", "gen_ai.request.model": CHAT_MODEL}
    # Start from settled counts: what earlier requests recorded is exported up to one interval
    # (300 ms here) later, and must not land in this test's difference.
    before: dict = {}
    for _ in range(20):
        time.sleep(0.7)
        now = {n: _count(served, n, **chat_ok) for n in names}
        if now == before:
            break
        before = now
    before_err = _count(served, names[0], **{"error.type": "invalid_request_error"})
    before_text = _count(served, names[0], **{"gen_ai.operation.name": "text_completion"})
    for _ in range(2):
        assert http.post("/v1/chat/completions", json=chat(3), headers=served.headers()).status_code == 200
    assert http.post("/v1/completions", headers=served.headers(), json={
        "model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).status_code == 200
    bad = http.post("/v1/chat/completions", json=chat(4, temperature=-1), headers=served.headers())
    assert bad.status_code == 400
    # The 400 counts in the duration only (with error.type); token usage: input and output each.
    want = {names[0]: 3, names[1]: 2, names[2]: 2, names[3]: 4}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = {n: _count(served, n, **chat_ok) - before[n] for n in names}
        if got == want and _count(served, names[0], **{"error.type": "invalid_request_error"}) == before_err + 1:
            break
        time.sleep(0.2)
    assert got == want, got
    assert _count(served, names[0], **{"error.type": "invalid_request_error"}) == before_err + 1
    assert _count(served, names[0], **{"gen_ai.operation.name": "text_completion"}) == before_text + 1
    # (FastAPI's own `http.server.request.duration` comes along once a meter provider exists.)
    units = {p["name"]: p["unit"] for p in served.receiver.points if p["name"].startswith("gen_ai.")}
    assert units == {names[0]: "s", names[1]: "s", names[2]: "s", names[3]: "{token}"}, units
    usage = {p["attributes"]["gen_ai.token.type"]: p for p in served.receiver.latest_points(names[3])
             if p["attributes"]["gen_ai.operation.name"] == "chat"}
    assert usage["output"]["sum"] >= 6 and usage["input"]["sum"] > 0
    point = served.receiver.latest_points(names[1])[0]
    assert point["bounds"][:3] == (0.001, 0.005, 0.01) and point["service"] == "tokenpath"
    assert point["temporality"] == 2  # AGGREGATION_TEMPORALITY_CUMULATIVE
