"""`/v1/responses` through a real `tokenpath serve` (SmolLM2) with the real `openai` and
`openai-agents` clients, unchanged but for `base_url` and a key.

One server for the module, with two tenants' keys (auth on), and a 4 KiB cap per stored
conversation so the size refusal is reachable with small inputs.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseTextDeltaEvent,
)
from tests.api.conftest import CHAT_MODEL, Server

from tokenpath.gateway import GatewayStore
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import OPEN_STATUS

pytestmark = pytest.mark.slow

CONFIG = f"models: [{CHAT_MODEL}]\nresponses_max_bytes: 4096\n"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[tuple[Server, str, str]]:
    """A server with keys for tenants 'alpha' and 'beta'."""
    tmp = tmp_path_factory.mktemp("responses")
    (tmp / "data").mkdir()
    store = GatewayStore(tmp / "data" / "gateway.sqlite3")
    try:
        alpha, _ = create_key(store, "alpha")
        beta, _ = create_key(store, "beta")
    finally:
        store.close()
    (tmp / "server.yaml").write_text(CONFIG)
    # Every row's activations fine (--kernels-prompt-fine 31, and no bf16 tiles for prompt rows on
    # an AMX CPU: --kernels-bf16 0): the Agents SDK loop below needs the 135M model to stop calling
    # tools within its turns, a greedy choice at a near-tie that the default prompt mask's int8
    # matmuls flip, and the tiles' bf16 rows too (it then calls them until max_turns).
    srv = launch_server(tmp, "--config", str(tmp / "server.yaml"), "--kernels-prompt-fine", "31",
                        "--kernels-bf16", "0")
    try:
        yield srv, alpha, beta
    finally:
        code = srv.stop()
    assert code == 0, srv.output()[-3000:]


def client(srv: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=300)


def audit_row(data_dir: Path, request_id: str):
    """The request's closed audit row (written by the server's `finally`: waited for, bounded)."""
    store = GatewayStore(data_dir / "gateway.sqlite3")
    try:
        deadline = time.monotonic() + 60
        while True:
            rows = store.query_audit(request_id=request_id)
            if (rows and rows[0].status != OPEN_STATUS) or time.monotonic() > deadline:
                return rows[0] if rows else None
            time.sleep(0.1)
    finally:
        store.close()


def test_create_non_streaming_is_audited_like_chat(keyed):
    srv, alpha, _ = keyed
    raw = client(srv, alpha).responses.with_raw_response.create(
        model=CHAT_MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0,
        metadata={"run": "t1"})
    r = raw.parse()
    assert "server-timing" in raw.headers
    row = audit_row(srv.log.parent / "data", raw.headers["x-request-id"])
    assert row is not None and row.endpoint == "/v1/responses" and row.tenant == "alpha" and row.status == 200
    assert row.model == CHAT_MODEL and row.completion_tokens == r.usage.output_tokens
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output[0].content[0].annotations == []
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.metadata == {"run": "t1"}
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streaming_events_parse_in_the_sdk_and_come_in_order(keyed):
    srv, alpha, _ = keyed
    c = client(srv, alpha)
    events = list(c.responses.create(model=CHAT_MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Count to three."}]}], max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert isinstance(events[0], ResponseCreatedEvent) and kinds[1] == "response.in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert text and events[-4].text == text and events[-1].response.output[0].content[0].text == text
    # The SDK's own accumulating stream helper takes every event too.
    with c.responses.stream(model=CHAT_MODEL, input="Say hi.", max_output_tokens=8) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text and final.usage.output_tokens > 0


def test_function_tool_round_trip_required_is_grammar_constrained(keyed):
    srv, alpha, _ = keyed
    c = client(srv, alpha)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.responses.create(model=CHAT_MODEL, input=asked, tools=[WEATHER], tool_choice="required",
                           max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id and calls[0].id.startswith("fc_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    history = asked + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    answer = c.responses.create(model=CHAT_MODEL, input=history, tools=[WEATHER], tool_choice="none",
                                max_output_tokens=20, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text
    named = c.responses.create(model=CHAT_MODEL, input=asked, tools=[WEATHER, {**WEATHER, "name": "get_time"}],
                               tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=60)
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]
    # Streamed: the call's arguments arrive as argument deltas, then .done with the whole text.
    events = list(c.responses.create(model=CHAT_MODEL, input=asked, tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=60, temperature=0, stream=True))
    done = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert done and [e.output_index for e in done] == list(range(len(done)))
    for d in done:  # (required allows parallel calls: each item's deltas add up to its arguments)
        deltas = [e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)
                  and e.item_id == d.item_id]
        assert deltas and "".join(deltas) == d.arguments and json.loads(d.arguments)
    assert isinstance(events[-1], ResponseCompletedEvent)
    assert [o.type for o in events[-1].response.output] == ["function_call"] * len(done)


def test_previous_response_id_chain_retrieve_and_delete(keyed):
    srv, alpha, _ = keyed
    c = client(srv, alpha)
    first = c.responses.create(model=CHAT_MODEL, input="My name is Ada.", max_output_tokens=8)
    second = c.responses.create(model=CHAT_MODEL, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=8)
    assert second.previous_response_id == first.id
    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    items = c.responses.input_items.list(second.id, order="asc").data
    texts = [json.dumps(i.model_dump()) for i in items]
    assert "My name is Ada." in texts[0] and first.output_text[:5] in texts[1] and "What is my name?" in texts[2]
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=CHAT_MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
    unstored = c.responses.create(model=CHAT_MODEL, input="Hi", store=False, max_output_tokens=4)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_another_tenants_response_is_the_same_404_as_an_unknown_one(keyed):
    srv, alpha, beta = keyed
    mine = client(srv, alpha).responses.create(model=CHAT_MODEL, input="Secret plan.", max_output_tokens=4)
    other = client(srv, beta)
    bodies = []
    for rid in (mine.id, "resp_" + "0" * 32):
        with pytest.raises(openai.NotFoundError) as e1:
            other.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=CHAT_MODEL, input="Go on", previous_response_id=rid, max_output_tokens=4)
        bodies.append(e1.value.body["message"].replace(rid, "ID"))
    assert bodies[0] == bodies[1]
    assert client(srv, alpha).responses.retrieve(mine.id).id == mine.id  # still there for its tenant


def test_bad_input_is_a_400_naming_the_field(keyed):
    srv, alpha, _ = keyed
    c = client(srv, alpha)
    cases = [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input.0.content.0"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"type": "reasoning", "summary": "x"}]}, "input.0.summary"),
        ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}]},
         "input.0.content.0"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),  # (SmolLM2 does not reason)
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"instructions": "Be brief.", "input": [  # a pipeline check, named by the item it came from
            {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                "arguments": "{not json"}]}, "input.1.arguments"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "x" * 5000}, "input"),  # over the 4 KiB cap per stored conversation
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=CHAT_MODEL, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
    assert re.search(r"is \d{4,} bytes, over this server's cap of 4096 bytes", err.value.body["message"])
    # The same input is fine when it is not stored.
    ok = c.responses.create(model=CHAT_MODEL, input="x" * 5000, store=False, max_output_tokens=2)
    assert ok.status in ("completed", "incomplete")


def test_structured_output_through_text_format(keyed):
    srv, alpha, _ = keyed
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client(srv, alpha).responses.create(
        model=CHAT_MODEL, input="Pick a color.", max_output_tokens=20,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["color"] in ("red", "blue")


def test_openai_agents_two_tool_loop(keyed):
    srv, alpha, _ = keyed
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    used: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        used.append("weather")
        return f"It is sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        used.append("time")
        return f"It is noon in {city}."

    model = OpenAIResponsesModel(CHAT_MODEL, openai.AsyncOpenAI(base_url=srv.base_url, api_key=alpha,
                                                                   max_retries=0, timeout=300))
    agent = Agent(name="helper", instructions="Answer using the tools.", model=model, tools=[get_weather, get_time],
                  model_settings=ModelSettings(tool_choice="required", max_tokens=400, temperature=0),
                  reset_tool_choice=True)
    async def both() -> tuple[object, list[str], object, set[str]]:  # (one loop: the client's pool is bound to it)
        result = await Runner.run(agent, "What are the weather and the time in Paris?", max_turns=6)
        first = list(used)
        run = Runner.run_streamed(agent, "What are the weather and the time in Paris?", max_turns=6)  # the SDK's stream parser
        return result, first, run, {event.type async for event in run.stream_events()}

    result, first, run, kinds = asyncio.run(both())
    assert first, "no tool ran"
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and isinstance(result.final_output, str)
    assert len(used) > len(first) and "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert any(i.type == "tool_call_output_item" for i in run.new_items)


def test_the_operator_can_turn_storing_off(tmp_path_factory: pytest.TempPathFactory, server_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "server.yaml"
    cfg.write_text(f"models: [{CHAT_MODEL}]\nresponses_store: false\n")
    srv = server_factory("--config", str(cfg))
    c = client(srv, "none")
    r = c.responses.create(model=CHAT_MODEL, input="Hi", max_output_tokens=2)  # store defaults to true...
    assert r.store is False  # ...but nothing is kept
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=CHAT_MODEL, input="Go on", previous_response_id=r.id, max_output_tokens=2)
