"""Agent frameworks, unchanged but for `base_url` and a key, against the default `tokenpath serve`
(issue 35 item 7): pydantic-ai's OpenAI models (`OpenAIChatModel` on /v1/chat/completions and
`OpenAIResponsesModel` on /v1/responses, which its `openai:` strings now mean) and LangChain's
`ChatAnthropic` on /v1/messages. Each runs its quick-start (a run, a streamed run) and a tool round
trip: call, the tool's result sent back as history, then an answer the framework parses.

The tiny model is driven to the tool as the other agent tests drive it: by the framework's own
`tool_choice` (pydantic-ai's per-step setting from a capability; LangChain's `bind_tools(tool_choice=)`),
which the server's tool grammar turns into a call that always parses.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

CHAT_MODEL = "smollm2-135m-instruct"
ASK = "Name three colours."


# -- pydantic-ai ------------------------------------------------------------------------------------
def _pydantic_models(server) -> list:  # noqa: ANN001
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=server.base_url, api_key="unused")
    return [OpenAIChatModel(CHAT_MODEL, provider=provider), OpenAIResponsesModel(CHAT_MODEL, provider=provider)]


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_run_and_stream(server, kind):
    from pydantic_ai import Agent

    model = _pydantic_models(server)[["chat", "responses"].index(kind)]
    agent = Agent(model, model_settings={"max_tokens": 12, "temperature": 0})

    async def both() -> tuple[object, list[str], object]:
        result = await agent.run(ASK)
        async with agent.run_stream(ASK) as stream:
            deltas = [d async for d in stream.stream_text(delta=True)]
            usage = stream.usage
        return result, deltas, usage

    result, deltas, usage = asyncio.run(both())
    assert isinstance(result.output, str) and result.output
    assert 0 < result.usage.output_tokens <= 12 and result.usage.input_tokens > 0
    assert "".join(deltas) == result.output  # (greedy: the same text, streamed)
    assert usage.output_tokens == result.usage.output_tokens and usage.input_tokens == result.usage.input_tokens


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_tool_round_trip_to_structured_output(server, kind):
    """Step 1 must call get_weather, step 2 must give the structured result (pydantic-ai's output
    tool): the tool's return goes back as a `tool` message / `function_call_output` item."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.usage import UsageLimits

    class Weather(BaseModel):
        city: str
        summary: str

    class ToolThenAnswer(AbstractCapability):
        def get_model_settings(self):  # noqa: ANN202
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"]}

    model = _pydantic_models(server)[["chat", "responses"].index(kind)]
    agent = Agent(model, output_type=Weather, capabilities=[ToolThenAnswer()],
                  model_settings={"max_tokens": 120, "temperature": 0}, instructions="Use the tool, then answer.")
    used: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        used.append(city)
        return f"Sunny in {city}."

    result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=4))
    assert used, "the tool never ran"
    assert isinstance(result.output, Weather) and result.output.city
    parts = [type(p) for m in result.all_messages() for p in m.parts]
    assert parts.count(ToolReturnPart) >= 2 and ToolCallPart in parts  # get_weather's and final_result's

    async def streamed() -> object:  # the same loop streamed: tool-call argument deltas, parsed as they come
        async with agent.run_stream("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=4)) as run:
            return await run.get_output()

    ran = len(used)
    assert isinstance(asyncio.run(streamed()), Weather) and len(used) == ran + 1


# -- LangChain ChatAnthropic ------------------------------------------------------------------------
def _claude(server, **kw):  # noqa: ANN001, ANN202
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(model=CHAT_MODEL, base_url=server.url, api_key="unused", max_retries=0, temperature=0,
                         **{"max_tokens": 12, **kw})


def test_langchain_chat_anthropic_invoke_and_stream(server):
    llm = _claude(server)
    whole = llm.invoke(ASK)
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(llm.stream(ASK))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == whole.content and len(chunks) > 2
    # The stream's usage is the same as the whole reply's (the prompt's count was 0 here before
    # message_delta carried the whole usage).
    assert total.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"] > 0
    assert total.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"] > 0


def test_langchain_chat_anthropic_bind_tools_round_trip(server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}."

    forced = _claude(server, max_tokens=60).bind_tools([get_weather], tool_choice="get_weather")
    history: list = [HumanMessage("What is the weather in Paris?")]
    call = forced.invoke(history)
    assert call.response_metadata["stop_reason"] == "tool_use"
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and call.tool_calls[0]["args"].get("city")
    streamed = list(forced.stream(history))
    total = streamed[0]
    for c in streamed[1:]:
        total = total + c
    assert total.tool_calls == call.tool_calls or [c["args"] for c in total.tool_calls] == [
        c["args"] for c in call.tool_calls]
    history += [call, ToolMessage(get_weather.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"])]
    answer = _claude(server, max_tokens=60).bind_tools([get_weather]).invoke(history)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)
    assert answer.usage_metadata["input_tokens"] > call.usage_metadata["input_tokens"]  # (the history grew)
