"""Thinking sent back in the history reaches the chat template as the assistant turn's
`reasoning_content` (issue 35): Anthropic `thinking` blocks, Responses `reasoning` items and chat
completions' `reasoning_content`, each through its API's own translation and the same prompt
rendering the server does (`inputs.chat_messages`, the real SmolLM2 tokenizer, the real Qwen3 and
Llama 3.1 templates). Qwen3's template writes a turn's reasoning inside `<think>` for the turns
after the last user query, so a tool-use loop goes on with its reasoning; Llama 3.1's has no such
field and renders none of it. End to end with the SDKs: tests/api/test_reasoning_agents.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenpath.api import tools
from tokenpath.api.anthropic.schemas import MessagesRequest
from tokenpath.api.anthropic.translate import to_chat
from tokenpath.api.inputs import chat_messages
from tokenpath.api.responses.schemas import ResponsesRequest
from tokenpath.api.responses.translate import chat_messages as responses_messages
from tokenpath.api.responses.translate import chat_request, input_items
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import InvalidRequestError

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
QWEN3, LLAMA = "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"
THOUGHT = "The user wants the weather in Paris; the get_weather tool gives it."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def source() -> Path:
    return resolve_model_path("smollm2-135m-instruct")


def _render(source: Path, template: str, body: ChatCompletionRequest) -> str:
    tok = Tokenizer(source, chat_template=TEMPLATES / template)
    plan = tools.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tok.chat_template)
    messages, passed = chat_messages(body, plan, tok.chat_template)
    return tok.decode(tok.apply_chat_template(messages, True, passed), skip_special_tokens=False)


def _messages_round_trip() -> ChatCompletionRequest:
    return to_chat(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 16, "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "messages": [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": "(checked by the route)"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C, sunny"}]},
        ]}))


def _responses_round_trip() -> ChatCompletionRequest:
    req = ResponsesRequest.model_validate({
        "model": "m", "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "input": [
            {"role": "user", "content": ASK},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
        ]})
    return chat_request(req, responses_messages(input_items(req.input), None))


def _chat_round_trip() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "messages": [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        ]})


ROUND_TRIPS = [_messages_round_trip, _responses_round_trip, _chat_round_trip]


@pytest.mark.parametrize("round_trip", ROUND_TRIPS, ids=["messages", "responses", "chat"])
def test_returned_thinking_is_rendered_inside_think_by_qwen3(source, round_trip):
    body = round_trip()
    assistant = next(m for m in body.messages if m.role == "assistant")
    assert assistant.reasoning_content == THOUGHT  # (the redacted block adds nothing)
    prompt = _render(source, QWEN3, body)
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n<tool_call>" in prompt, prompt
    assert "<tool_response>\n18C, sunny\n</tool_response>" in prompt  # (the round trip's result, after it)


@pytest.mark.parametrize("round_trip", ROUND_TRIPS, ids=["messages", "responses", "chat"])
def test_a_template_without_the_field_renders_none_of_it(source, round_trip):
    prompt = _render(source, LLAMA, round_trip())
    assert THOUGHT not in prompt and "<think>" not in prompt
    assert '"city": "Paris"' in prompt  # (the call itself is still there)


def test_reasoning_before_the_last_user_query_is_left_out_by_qwen3(source):
    """The template's own rule: earlier turns' reasoning is dropped, as the model was trained."""
    body = _chat_round_trip()
    later = body.model_copy(update={"messages": [*body.messages, body.messages[0].model_copy(
        update={"content": "And in Rome?"})]})
    prompt = _render(source, QWEN3, later)
    assert THOUGHT not in prompt and prompt.rstrip().endswith("<|im_start|>assistant")


def test_reasoning_not_followed_by_its_turn_is_not_carried_to_a_later_one():
    items = input_items([{"role": "user", "content": "hi"},
                         {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
                         {"role": "user", "content": "still there?"},
                         {"role": "assistant", "content": "yes"}])
    messages = responses_messages(items, None)
    assert [m["role"] for m in messages] == ["user", "user", "assistant"]
    assert all("reasoning_content" not in m for m in messages)


@pytest.mark.parametrize(("content", "param"), [
    ("text", "input.1.content"),
    ([{"type": "summary_text", "text": "x"}], "input.1.content.0"),
    ([{"type": "reasoning_text", "text": 3}], "input.1.content.0"),
])
def test_a_malformed_reasoning_item_is_refused_naming_it(content, param):
    with pytest.raises(InvalidRequestError) as err:
        input_items([{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "content": content}])
    assert err.value.param == param


def test_a_thinking_block_that_is_not_text_is_refused_naming_it():
    with pytest.raises(InvalidRequestError) as err:
        to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": 3, "signature": "s"},
                                              {"type": "text", "text": "hello"}]},
            {"role": "user", "content": "again"}]}))
    assert err.value.param == "messages.1.content.0.thinking"
