"""Anthropic's Messages API on a real `tokenpath serve`, through the real `anthropic` SDK, unchanged.

`messages.create`, `messages.stream` (the SDK's own parser accumulates every event), a tool-use
round trip (tool_choice `any`/`tool` go through the tool grammar, so the call always parses),
`count_tokens`, auth by `x-api-key`, and bad input answered in Anthropic's error shape naming the
field. LangChain's ChatAnthropic: tests/api/test_agent_frameworks.py.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

CHAT_MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Name three colours."}]
# This SDK (2.16) no longer has sampling parameters; the API still takes them in the body.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "The local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_create_message_shape_and_usage(client):
    raw = client.messages.with_raw_response.create(model=CHAT_MODEL, max_tokens=8, messages=HELLO,
                                                   system="You are terse.", metadata={"user_id": "u-1"},
                                                   extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    msg = raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == CHAT_MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 8
    assert raw.headers["x-request-id"] == msg.id and "total;dur=" in raw.headers["server-timing"]


def test_max_tokens_and_stop_sequence_reasons(client):
    cut = client.messages.create(model=CHAT_MODEL, max_tokens=2, messages=HELLO, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    full = client.messages.create(model=CHAT_MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY)
    text = full.content[0].text
    word = text.split()[1] if len(text.split()) > 1 else text[:2]
    stopped = client.messages.create(model=CHAT_MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY,
                                     stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_system_blocks_and_content_blocks(client):
    msg = client.messages.create(model=CHAT_MODEL, max_tokens=4, extra_body=GREEDY,
                                 system=[{"type": "text", "text": "You are terse."}],
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                        {"type": "text", "text": "there"}]}],
                                 thinking={"type": "disabled"})
    assert msg.content and msg.usage.input_tokens > 0


def test_stream_every_event_parsed_and_final_message(client):
    kinds = []
    with client.messages.stream(model=CHAT_MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "ping" not in kinds or kinds.index("ping") == 1  # (the SDK may hide pings)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "message_delta" in kinds and "text" in kinds
    assert final.id.startswith("msg_") and final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 12
    assert final.usage.input_tokens > 0
    same = client.messages.create(model=CHAT_MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert same.content[0].text == final.content[0].text


def test_raw_stream_event_lines(server):
    """The wire: each event's `event:` line names its data's `type`, and a ping follows message_start."""
    body = {"model": CHAT_MODEL, "max_tokens": 4, "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    names = []
    for e in events:
        head, data = e.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == head[7:]
        names.append(head[7:])
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use_round_trip(client, choice):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model=CHAT_MODEL, max_tokens=60, messages=ask, tools=[WEATHER, TIME],
                                 tool_choice=choice, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].id.startswith("toolu_") and isinstance(uses[0].input, dict)
    assert uses[0].name in ("get_weather", "get_time") and isinstance(uses[0].input.get("city"), str)
    if choice["type"] == "tool":
        assert all(u.name == "get_weather" for u in uses)
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"}
                                                  for u in uses]}]
    reply = client.messages.create(model=CHAT_MODEL, max_tokens=20, messages=history, tools=[WEATHER, TIME],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"


def test_tool_use_streamed(client):
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    with client.messages.stream(model=CHAT_MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    use = final.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    same = client.messages.create(model=CHAT_MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert same.content[-1].input == use.input


def test_count_tokens_matches_usage(client):
    counted = client.messages.count_tokens(model=CHAT_MODEL, messages=HELLO, system="You are terse.")
    msg = client.messages.create(model=CHAT_MODEL, max_tokens=1, messages=HELLO, system="You are terse.")
    assert counted.input_tokens == msg.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model=CHAT_MODEL, messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_thinking_accepted_and_named_as_ignored(server):
    body = {"model": CHAT_MODEL, "max_tokens": 3, "messages": HELLO,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["x-tokenpath-ignored"] == "thinking"
    assert [b["type"] for b in r.json()["content"]] == ["text"]
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.headers["x-tokenpath-ignored"] == "thinking" and "event: message_stop" in r.read().decode()


def test_same_path_metrics_and_request_log(server):
    """A Messages request is counted and logged like any other, under its own endpoint."""
    def count(status: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        pattern = rf'^tokenpath:requests_total\{{(?=.*endpoint="/v1/messages")(?=.*status="{status}").*\}} (\S+)$'
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
    ok, bad = count("200"), count("400")
    httpx.post(server.url + "/v1/messages", json={"model": CHAT_MODEL, "max_tokens": 2, "messages": HELLO},
               headers={"x-request-id": "msg-metrics-1"}, timeout=120)
    httpx.post(server.url + "/v1/messages", json={"model": CHAT_MODEL, "messages": HELLO}, timeout=120)
    assert (count("200") - ok, count("400") - bad) == (1, 1)
    assert '"client_request_id":"msg-metrics-1"' in server.output() and '"endpoint":"/v1/messages"' in server.output()


def _error(exc: anthropic.APIStatusError) -> dict:
    body = exc.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


@pytest.mark.parametrize("kwargs, field", [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages.0.content.1"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
     "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
     "messages.1.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"name": "x"}]}, "tools.0.input_schema"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type"),
    ({"max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]},
     "tools.0.name"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"name": "x", "input_schema": {"type": "objekt"}}]},
     "tools.0.input_schema"),
    ({"max_tokens": 5, "messages": HELLO, "mcp_servers": []}, "mcp_servers"),
    ({"max_tokens": 5, "messages": HELLO, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": HELLO, "temperature": 1.5}, "temperature"),
])
def test_bad_input_is_a_400_in_anthropic_shape(server, kwargs, field):
    r = httpx.post(server.url + "/v1/messages", json={"model": CHAT_MODEL, **kwargs}, timeout=120)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"], body
    assert r.headers.get("x-request-id", "msg_").startswith("msg_")


def test_sdk_sees_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=CHAT_MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.invalid/x.png"}}]}])
    assert "image" in _error(bad.value)["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HELLO)
    assert _error(missing.value)["type"] == "not_found_error"
    r = httpx.post(str(client.base_url).rstrip("/") + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_limits_and_unknown_paths_in_anthropic_shape(server):
    """Refusals made before the route runs (body size, an unknown path) keep Anthropic's shape here."""
    big = {"model": CHAT_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    r = httpx.post(server.url + "/v1/messages", json=big, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(server.url + "/v1/messages/nope", json={}, timeout=60)
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {"type": "not_found_error",
                                                                           "message": "Not Found"}}
    r = httpx.post(server.url + "/v1/messages", content=b"", timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_x_api_key_auth(server_factory):
    srv = server_factory("--model", CHAT_MODEL, "--api-key", "k-anthropic")
    good = anthropic.Anthropic(base_url=srv.url, api_key="k-anthropic", max_retries=0, timeout=120)
    assert good.messages.create(model=CHAT_MODEL, max_tokens=2, messages=HELLO).content
    assert good.messages.count_tokens(model=CHAT_MODEL, messages=HELLO).input_tokens > 0
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model=CHAT_MODEL, max_tokens=2, messages=HELLO)
    assert _error(exc.value)["type"] == "authentication_error"
    # the OpenAI routes take x-api-key too, and two different keys are refused, never picked from
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"x-api-key": "k-anthropic"},
                   json={"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "k-anthropic", "authorization": "Bearer other"},
                   json={"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 1}, timeout=120)
    assert r.status_code == 400 and "different keys" in r.json()["error"]["message"]


TIGHT = f"""
deployments:
  - name: {CHAT_MODEL}
    task: chat
    replicas: [{{local: 1}}]
    pool: {{max_inflight: 1}}
    admission: {{max_queue: 0}}
"""


def test_full_server_is_529_overloaded_with_retry_after(server_factory, tmp_path_factory):
    """One slot and no queue: while an endless chat stream holds the slot (its admission seen on
    /metrics), a Messages request is refused at once as Anthropic refuses when it is full: 529
    `overloaded_error` with `retry-after` (429 `queue_full` on the OpenAI routes)."""
    routing = tmp_path_factory.mktemp("routing") / "tight.yaml"
    routing.write_text(TIGHT)
    srv = server_factory("--model", CHAT_MODEL, "--routing", str(routing))
    hold = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=hold, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # (kept: a dropped iterator closes the stream)
        assert next(lines).startswith("data: ")  # generating: the slot is taken
        r = httpx.post(srv.url + "/v1/messages", json={"model": CHAT_MODEL, "max_tokens": 5, "messages": HELLO},
                       timeout=120)
    assert r.status_code == 529, r.text
    assert r.json()["error"]["type"] == "overloaded_error" and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-request-id"].startswith("msg_")
    ok = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=3, timeout=120)
    assert ok.messages.create(model=CHAT_MODEL, max_tokens=2, messages=HELLO).content  # (after the abort)
