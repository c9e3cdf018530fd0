"""Structured output and tool calls (issue 22) against a real `tokenpath serve` (SmolLM2), through
real clients: the `openai` client's `parse()` and streamed tool calls, `langchain-openai`, raw HTTP
for vLLM's names and the 400s. Outputs are validated with `jsonschema` against schemas that only
this file knows (the implementation never sees them before the request)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from tests.api.test_replicas import audit_row

CHAT = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Describe a person called Ada, born 1815, as JSON."}]

# Held-out schemas: nested objects, enums, arrays with bounds, numbers with ranges, $defs.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "born": {"type": "integer", "minimum": 1000, "maximum": 2100}},
     "required": ["name", "born"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                      "temps": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                                                "maxItems": 3}},
     "required": ["city", "temps"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "ok": {"type": "boolean"}},
     "required": ["a", "ok"], "additionalProperties": False},
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


class Person(BaseModel):
    name: str
    age: int


def test_openai_parse_with_a_pydantic_model(client):
    resp = client.chat.completions.parse(model=CHAT, messages=ASK, response_format=Person, max_tokens=60,
                                         temperature=0.7, seed=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_held_out_schemas_validate_n2_sampled(client, schema):
    resp = client.chat.completions.create(model=CHAT, messages=ASK, response_format=_schema_format(schema),
                                          n=2, temperature=1.0, max_tokens=80, seed=11)
    assert len(resp.choices) == 2
    for c in resp.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)


def test_streamed_json_schema_with_logprobs(client):
    schema = SCHEMAS[1]
    stream = client.chat.completions.create(model=CHAT, messages=ASK, response_format=_schema_format(schema),
                                            max_tokens=60, stream=True, logprobs=True, temperature=0.5,
                                            stream_options={"include_usage": True})
    text, reasons, lps, usage = "", [], 0, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            lps += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(text), schema)
    assert lps == usage.completion_tokens > 0


def test_cut_off_json_ends_with_length(client):
    resp = client.chat.completions.create(model=CHAT, messages=ASK, response_format=_schema_format(SCHEMAS[0]),
                                          max_tokens=4)
    c = resp.choices[0]
    assert c.finish_reason == "length" and c.message.content.startswith("{")


def test_json_object_and_stop_string(client):
    resp = client.chat.completions.create(model=CHAT, messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=120, temperature=0.8, n=4, seed=5)
    done = [c for c in resp.choices if c.finish_reason == "stop"]
    assert done and all(c.finish_reason == "length" for c in resp.choices if c not in done)
    for c in done:  # any object; one that ran out of tokens is cut off, as OpenAI's are
        assert isinstance(json.loads(c.message.content), dict)
    cut = client.chat.completions.create(model=CHAT, messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=80, temperature=0, stop=[":"])
    assert cut.choices[0].finish_reason == "stop" and ":" not in cut.choices[0].message.content


def test_vllm_names_on_chat_and_completions(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        def chat(**extra):  # noqa: ANN202
            r = http.post("/v1/chat/completions", json={"model": CHAT, "messages": ASK, "max_tokens": 20, **extra})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        assert chat(structured_outputs={"choice": ["yes", "no"]})["message"]["content"] in ("yes", "no")
        assert chat(guided_choice=["red", "blue"])["message"]["content"] in ("red", "blue")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", chat(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
                            ["message"]["content"])
        cut = chat(guided_regex="(ab)+", max_tokens=6)  # may run to max_tokens: a prefix of the language
        assert re.fullmatch(r"(ab)+" if cut["finish_reason"] == "stop" else r"(ab)*a?", cut["message"]["content"])
        assert chat(structured_outputs={"grammar": 'start: "A" | "B" "C"'})["message"]["content"] in ("A", "BC")
        r = http.post("/v1/completions", json={"model": CHAT, "prompt": "A person as JSON: ", "max_tokens": 60,
                                               "guided_json": SCHEMAS[0], "temperature": 0.8, "n": 2})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "stop"
            jsonschema.validate(json.loads(c["text"]), SCHEMAS[0])


def test_required_tool_call_parses(client):
    resp = client.chat.completions.create(model=CHAT, messages=WEATHER_ASK, tools=[WEATHER, ADD],
                                          tool_choice="required", max_tokens=150, temperature=0.7)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert resp.usage.completion_tokens > 5  # the call's tokens are counted


def test_named_tool_call_streamed_and_assembled(client):
    stream = client.chat.completions.create(model=CHAT, messages=WEATHER_ASK, tools=[WEATHER, ADD],
                                            tool_choice={"type": "function", "function": {"name": "add"}},
                                            max_tokens=60, stream=True)
    calls: dict[int, dict] = {}
    firsts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id, type and name, arguments ""
                    firsts.append(tc)
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                    assert tc.id and tc.type == "function" and tc.function.arguments == ""
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
    assert reasons == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["add"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])


def test_tool_history_round_trip_and_auto(client):
    history = [*WEATHER_ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    resp = client.chat.completions.create(model=CHAT, messages=history, tools=[WEATHER], max_tokens=30,
                                          temperature=0)
    c = resp.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason == "tool_calls":  # auto: whatever the model wrote parsed as a known call
        assert c.message.tool_calls[0].function.name == "get_weather"
    else:
        assert c.message.content


def test_langchain_structured_output_and_bind_tools(server):
    import langchain_openai  # a [test] dependency: missing fails, never skips
    from langchain_core.tools import tool

    # Seeded, with room for the reply: an unseeded sample cut at its token limit is invalid JSON
    # for LangChain's parser (a flake under `make test`, not a fault of the constraint).
    llm = langchain_openai.ChatOpenAI(model=CHAT, base_url=server.base_url, api_key="unused", max_tokens=200,
                                      temperature=0.5, max_retries=0, seed=7)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe Ada, born 1815.")
    assert isinstance(person, Person)

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    msg = llm.bind_tools([multiply], tool_choice="multiply").invoke("What is 6 times 7?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "multiply"
    assert set(msg.tool_calls[0]["args"]) == {"a", "b"}


BAD = [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": _schema_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format", "uniqueItems"),
    ({"response_format": _schema_format({"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}})},
     "response_format.json_schema.schema", "over the limit"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tools": [WEATHER] * 200}, "tools", "over the limit"),
    ({"messages": [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "JSON"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_constraints_are_400_naming_the_problem(server, extra, param, words):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": CHAT, "messages": ASK, "max_tokens": 5, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        ok = http.post("/v1/chat/completions", json={"model": CHAT, "messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200  # the server is unaffected


def test_metrics_and_audit_row_carry_the_grammar(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT, messages=ASK, response_format={"type": "json_object"}, max_tokens=5)
    text = httpx.get(server.url + "/metrics").text
    kinds = dict(re.findall(r'^tokenpath:structured_requests_total\{kind="(\w+)"\} (\S+)$', text, re.M))
    assert float(kinds.get("json", 0)) >= 1, kinds
    grammar = json.loads(audit_row(server, raw.headers["x-request-id"]).timing)["grammar"]
    assert grammar["kind"] == "json" and isinstance(grammar["cache_hit"], bool) and grammar["compile_ms"] >= 0
    assert grammar["mask_us_per_token"] > 0 and "engine_cache_hit" in grammar


@pytest.mark.slow
def test_replicas_engine_processes_enforce_the_schema(server_factory):
    """`--replicas 2`: the spec crosses the engine link and each engine process compiles it."""
    srv = server_factory("--model", CHAT, "--num-kv-blocks", "256", "--replicas", "2")
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        for i in range(3):  # short distinct prompts rotate over the idle replicas
            r = http.post("/v1/chat/completions", json={
                "model": CHAT, "messages": [{"role": "user", "content": f"Person {i} as JSON."}], "max_tokens": 60,
                "temperature": 0.8, "response_format": _schema_format(SCHEMAS[0])})
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "stop"
            jsonschema.validate(json.loads(c["message"]["content"]), SCHEMAS[0])
        r = http.post("/v1/chat/completions", json={"model": CHAT, "messages": WEATHER_ASK, "tools": [WEATHER],
                                                    "tool_choice": "required", "max_tokens": 80})
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
