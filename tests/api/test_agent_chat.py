"""Agent loops on chat completions, through the real `openai` SDK against a real server (issue 35
item 5): each reply sent back as `message.model_dump()`, a tool-call round trip included; every
OpenAI request field's fate (api/openai_fields.py); `GET /ping`."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from openai.types.chat import completion_create_params

from tokenpath.api.openai_fields import CHAT_FIELDS, IGNORED_HEADER, STREAM_OPTIONS
from tokenpath.api.schemas import ChatCompletionRequest, StreamOptions

CHAT_MODEL = "smollm2-135m-instruct"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
HELLO = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_agent_loop_sends_model_dump_back_as_history(client):
    """The SDK's own dump of each reply (annotations, audio, function_call, refusal as nulls) is
    valid history: a tool call, its result, the answer, and one more user turn."""
    messages: list[dict] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    first = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=[ADD], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls, first
    dumped = msg.model_dump()
    assert {"annotations", "audio", "function_call", "refusal"} <= set(dumped)  # what broke it before
    messages.append(dumped)
    for call in msg.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    second = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=[ADD], max_tokens=12,
                                            temperature=0)
    messages.append(second.choices[0].message.model_dump())
    messages.append({"role": "user", "content": "Thanks. And 1 + 1?"})
    third = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=[ADD], max_tokens=12,
                                           temperature=0)
    assert third.choices[0].message.role == "assistant"
    # a dump that also carries a reasoning model's fields (and their nulls) is history too
    history = [*HELLO, {**second.choices[0].message.model_dump(), "reasoning_content": "thought", "reasoning": None,
                        "annotations": [], "audio": None}, {"role": "user", "content": "Again."}]
    assert client.chat.completions.create(model=CHAT_MODEL, messages=history, max_tokens=4).choices


# -- every field's fate ---------------------------------------------------------------------------
# A value of each field that asks for something, for the fields the server must be sent to check.
SAMPLES = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": {"name": "f"},
    "functions": [{"name": "f", "parameters": {}}], "modalities": ["text", "audio"],
    "moderation": {"policy": {"input": {"mode": "block"}}}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "metadata": {"k": "v"}, "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h", "safety_identifier": "user-123", "service_tier": "auto", "store": True,
    "verbosity": "low",
}


def test_every_sdk_field_has_a_fate():
    """A field the installed SDK can send and the table does not know fails here, not in production."""
    sdk = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    assert sdk - set(CHAT_FIELDS) == set()
    assert set(completion_create_params.ChatCompletionStreamOptionsParam.__annotations__) <= set(STREAM_OPTIONS)
    # every field with a fate is a field of the schema (refused ones too: refused by name, not as unknown)
    assert set(CHAT_FIELDS) <= set(ChatCompletionRequest.model_fields)
    assert set(STREAM_OPTIONS) <= set(StreamOptions.model_fields)
    assert all(f.kind in ("honoured", "ignored", "refused") for f in [*CHAT_FIELDS.values(), *STREAM_OPTIONS.values()])


@pytest.mark.parametrize("name", sorted(n for n, f in CHAT_FIELDS.items() if f.kind == "refused"))
def test_refused_fields_are_400s_naming_them(http, name):
    r = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2,
                                                 name: SAMPLES[name]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"], err


def test_ignored_fields_are_accepted_and_named_in_a_header(http):
    ignored = sorted(n for n, f in CHAT_FIELDS.items() if f.kind == "ignored")
    body = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2, **{n: SAMPLES[n] for n in ignored}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert sorted(r.headers[IGNORED_HEADER].split(", ")) == ignored
    plain = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2})
    assert IGNORED_HEADER not in plain.headers


def test_stream_options_include_obfuscation_is_a_named_no_op(client):
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=HELLO, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    assert raw.headers[IGNORED_HEADER] == "stream_options.include_obfuscation"
    chunks = list(raw.parse())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_newer_openai_fields_through_the_sdk(client):
    """What the issue found refused by name: now accepted (prompt_cache_key honoured, the rest named)."""
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=HELLO, max_tokens=3, prompt_cache_key="session-42", safety_identifier="u1",
        verbosity="low")
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers[IGNORED_HEADER] == "safety_identifier, verbosity"


def test_reasoning_effort_and_template_kwargs_on_a_model_without_reasoning(http):
    """SmolLM2's template has no reasoning: a level it cannot honour is refused by name; 'none' and
    template variables it never reads are accepted and named as ignored; reserved names are 400s."""
    base = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**base, "reasoning_effort": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = http.post("/v1/chat/completions", json={**base, "reasoning_effort": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = http.post("/v1/chat/completions", json={**base, "reasoning_effort": "none",
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_HEADER] == "chat_template_kwargs.enable_thinking, reasoning_effort"
    r = http.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


def test_ping_is_liveness(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        assert h.get("/ping").status_code == 200
        assert h.post("/ping").status_code == 200


def test_required_reply_cut_by_max_tokens_keeps_whole_calls(client):
    """SmolLM2 under `required` writes a second call that 60 tokens cut short: the first is kept and
    no markup reaches content (before: no tool_calls, the raw `<tool_call>` text as content)."""
    resp = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                          tools=[ADD], tool_choice="required", max_tokens=60, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "length", choice
    assert not choice.message.content or "tool_call" not in choice.message.content
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


def _decisions(text: str, outcome: str) -> float:
    """`tokenpath:routing_decisions_total` of the session_affinity policy with this outcome."""
    line = re.compile(r'^tokenpath:routing_decisions_total\{(?=[^}]*policy="session_affinity")'
                      rf'(?=[^}}]*outcome="{outcome}")[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in line.findall(text))


def test_prompt_cache_key_is_the_session_affinity_key(server_factory):
    """Under the session_affinity policy, a request with only `prompt_cache_key` routes by it (an
    `affinity` decision), as one with x-session-id does; one with neither has no session."""
    srv = server_factory("--model", CHAT_MODEL, "--routing-policy", "session_affinity")
    with httpx.Client(base_url=srv.url, timeout=120) as h:
        def count(outcome: str) -> float:
            return _decisions(h.get("/metrics").text, outcome)

        body = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 1}
        before = count("affinity"), count("no_session")
        assert h.post("/v1/chat/completions", json={**body, "prompt_cache_key": "conversation-7"}).status_code == 200
        assert (count("affinity"), count("no_session")) == (before[0] + 1, before[1])
        assert h.post("/v1/chat/completions", json=body).status_code == 200
        assert (count("affinity"), count("no_session")) == (before[0] + 1, before[1] + 1)


def test_load_counts_requests_in_flight(server):
    """vLLM's `GET /load` (its routers poll it): 404 before; the request in flight counts."""
    with httpx.Client(base_url=server.url, timeout=120) as h:
        idle = h.get("/load")
        assert idle.status_code == 200 and isinstance(idle.json()["server_load"], int)
        body = {"model": CHAT_MODEL, "prompt": "Count to a hundred:", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        with h.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            # Its first token is out, and 400 take seconds: in flight (leaving the block aborts it).
            # The line iterator is held: a discarded one is finalized at once, which closes the
            # response, and the server then sees a client that left (the CI flake: a 499, load 0).
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            load = h.get("/load").json()["server_load"]
            assert load >= 1, (first, load, h.get("/dashboard/data").json().get("inflight"))
            del lines
