"""The streaming client: SSE decoding, request bodies per target, and timing records taken from a
real HTTP server on loopback (tests/bench/stub_server.py)."""

import json

import httpx
import pytest
from stub_server import StubServer, StubState

from tokenpath.bench.client import (
    SSEDecoder,
    build_body,
    build_messages,
    chunk_content,
    messages_as_prompt,
    parse_server_timing,
    send,
)
from tokenpath.bench.records import RequestSpec, Target


def decode(lines):
    d = SSEDecoder()
    out = [p for line in lines if (p := d.feed(line)) is not None]
    if (p := d.flush()) is not None:
        out.append(p)
    return out


def test_sse_decoder_events_comments_multiline_and_crlf():
    lines = [": ping", "data: {\"a\": 1}", "", "data:{\"b\":", "data: 2}\r", "", "event: x", "data: [DONE]"]
    assert decode(lines) == ['{"a": 1}', '{"b":\n2}', "[DONE]"]


def test_server_timing_header_to_seconds():
    t = parse_server_timing("queue;dur=12.5, prefill;dur=4, decode;desc=\"d\";dur=100, total;dur=116.5")
    assert t == pytest.approx({"queue": 0.0125, "prefill": 0.004, "decode": 0.1, "total": 0.1165})
    assert parse_server_timing(None) is None
    assert parse_server_timing("cache;desc=hit") is None


def spec(**kw):
    base = dict(index=0, input_len=10, output_len=5, user_text="hello there")
    return RequestSpec(**{**base, **kw})


@pytest.mark.parametrize(("exact", "extra"), [
    ("vllm", {"ignore_eos": True, "min_tokens": 5}),
    ("min_tokens", {"min_tokens": 5}),
    ("hf", {"generation_config": json.dumps({"eos_token_id": -1})}),
    ("none", {}),
])
def test_body_forces_length_the_way_the_target_accepts(exact, extra):
    t = Target("t", "http://x/v1", "m", exact=exact)
    body = build_body(t, spec(), build_messages(spec()))
    forced = {k: body[k] for k in ("ignore_eos", "min_tokens", "generation_config") if k in body}
    assert forced == extra
    assert body["max_tokens"] == 5 and body["stream"] and body["stream_options"] == {"include_usage": True}


def test_messages_system_history_and_completions_transcript():
    s = spec(system_text="SYS")
    msgs = build_messages(s, [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert messages_as_prompt([{"role": "user", "content": "just this"}]) == "just this"
    assert messages_as_prompt(msgs).endswith("User: hello there\n\nAssistant:")
    body = build_body(Target("t", "http://x/v1", "m", api="completions"), s, msgs)
    assert "messages" not in body and body["prompt"].startswith("System: SYS")


def test_chunk_content_ignores_role_and_usage_chunks():
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}}]}, "chat") is None
    assert chunk_content({"choices": [{"delta": {"content": ""}}]}, "chat") is None
    assert chunk_content({"choices": [], "usage": {}}, "chat") is None
    assert chunk_content({"choices": [{"delta": {"content": "x"}}]}, "chat") == "x"
    assert chunk_content({"choices": [{"text": "y"}]}, "completions") == "y"


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_send_times_content_chunks_and_reads_usage_and_server_timing(api):
    with StubServer() as srv:
        target = Target("stub", srv.url, "m", api=api)
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await send(client, target, spec(output_len=6), build_messages(spec()))
        body = srv.state.bodies[0]
    assert r.success and r.status == 200 and r.error is None
    assert r.output_tokens == 6 and r.output_tokens_source == "usage"
    assert r.prompt_tokens == 2  # the stub counts words; the server's own count is what is kept
    assert len(r.itl) == 5  # gaps between 6 content chunks; the role-only chunk is not a token
    assert 0 < r.ttft <= r.e2el
    assert r.e2el == pytest.approx(r.ttft + sum(r.itl))
    assert r.server_timing == pytest.approx({"gateway": 0.0005, "queue": 0.001, "engine_queue": 0.0015,
                                             "prefill": 0.002, "decode": 0.003, "total": 0.008})
    assert r.text == "".join(f" w{i}" for i in range(6))
    assert body["ignore_eos"] is True and body["model"] == "m"


async def test_send_records_status_errors_empty_streams_and_refused_connections():
    state = StubState(fail={1: 429, 2: 503}, empty={3})
    with StubServer(state) as srv:
        target = Target("stub", srv.url, "m")
        async with httpx.AsyncClient(trust_env=False) as client:
            recs = [await send(client, target, spec(index=i), build_messages(spec())) for i in range(3)]
            dead = Target("dead", f"http://127.0.0.1:{srv.port}/nope", "m")
            missing = await send(client, dead, spec(), build_messages(spec()))
    assert [(r.success, r.status) for r in recs] == [(False, 429), (False, 503), (False, 200)]
    assert recs[0].error.startswith("http:") and "nope" in recs[0].error
    assert recs[2].error.startswith("no_content")
    assert not missing.success and missing.status == 404


async def test_send_connection_refused_is_a_counted_failure():
    from stub_server import free_port

    target = Target("gone", f"http://127.0.0.1:{free_port()}/v1", "m")
    async with httpx.AsyncClient(trust_env=False) as client:
        r = await send(client, target, spec(), build_messages(spec()))
    assert not r.success and r.status is None and r.error.startswith("connect")


async def test_output_tokens_fall_back_to_chunk_count_without_usage():
    state = StubState(usage=False)
    with StubServer(state) as srv:
        target = Target("stub", srv.url, "m", exact="none")
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await send(client, target, spec(output_len=3), build_messages(spec()))
    assert r.success and r.server_timing is None and r.prompt_tokens is None
    assert (r.output_tokens, r.output_tokens_source) == (3, "chunks")
    assert "ignore_eos" not in state.bodies[0] and "min_tokens" not in state.bodies[0]


async def test_total_timeout_bounds_a_slow_stream_and_api_key_is_sent():
    state = StubState(delay=0.5)
    with StubServer(state) as srv:
        target = Target("slow", srv.url, "m", api_key="sk-test")
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await send(client, target, spec(output_len=50), build_messages(spec()), total_timeout=0.8)
    assert not r.success and r.error.startswith("timeout:") and r.status == 200
    assert state.auth == ["Bearer sk-test"]
    assert Target("t", "u", "m", api_key="sk-test").public()["api_key"] == "set"  # never written out
