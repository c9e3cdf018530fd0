"""The tool-call formats per model family (Hermes/Qwen, Llama 3.1, tokenpath's tagged format for
templates without tools): detection, the constraint grammar against the real SmolLM2 tokenizer,
parsing, the streamed deltas, and the prompt each family's template is given."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenpath.api import formatting as fmt
from tokenpath.api import tools
from tokenpath.api.grammar_worker import GrammarWorkers
from tokenpath.api.inputs import chat_messages
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.api.structured import compile_checked
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.structured import GrammarCache
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.sampling_params import StructuredOutput

ADD = {"type": "function", "function": {"name": "add", "description": "Add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}
# The parts of the Qwen2.5 and Llama 3.1 templates that the format detection reads.
QWEN = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> <tool_call>{% endif %}"
LLAMA = "{% if tools %}Environment: ipython {{ tools | tojson }}{% endif %}<|python_tag|>"


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tok = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    return GrammarCache(tok.llg_tokenizer()), tok


def _accepts(cache, spec, text: str) -> bool:
    grammars, tok = cache
    m = grammars.get(spec).matcher
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


@pytest.mark.parametrize(("template", "fmt_name"), [(QWEN, "hermes"), (LLAMA, "llama3"), ("{{ x }}", "tagged"),
                                                   (None, "tagged")])
def test_format_follows_the_template(template, fmt_name):
    assert tools.template_format(template) == fmt_name


def test_hermes_required_grammar_and_parse(cache):
    plan = tools.parse_tools([ADD, ECHO], "required", None, QWEN)
    spec = tools.constraint(plan)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    two = call + '\n<tool_call>\n{"name": "echo", "arguments": {"s": "hi"}}\n</tool_call>'
    assert _accepts(cache, spec, call) and _accepts(cache, spec, two)
    assert not _accepts(cache, spec, '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>')
    content, calls = tools.parse_calls("Sure. " + two, plan)
    assert content == "Sure." and [c.name for c in calls] == ["add", "echo"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}


def test_llama3_named_grammar_and_parse(cache):
    plan = tools.parse_tools([ADD, ECHO], {"type": "function", "function": {"name": "echo"}}, None, LLAMA)
    spec = tools.constraint(plan)
    assert _accepts(cache, spec, '{"name": "echo", "parameters": {"s": "x"}}')
    assert not _accepts(cache, spec, '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    content, calls = tools.parse_calls('<|python_tag|>{"name": "echo", "parameters": {"s": "x"}}', plan)
    assert content is None and calls[0].name == "echo" and json.loads(calls[0].arguments) == {"s": "x"}
    assert tools.parse_calls("The answer is 4.", plan) == ("The answer is 4.", [])


def test_auto_never_invents_a_call():
    plan = tools.parse_tools([ADD], "auto", False, None)
    assert tools.parse_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', plan)[1] == []
    assert tools.parse_calls("<tool_call>{broken</tool_call>", plan)[1] == []
    one = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    assert len(tools.parse_calls(one + one, plan)[1]) == 1  # parallel_tool_calls false


TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "echo", "arguments": {"s": "hi"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
              '{"name": "echo", "parameters": {"s": "hi"}}',
    "tagged": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
              '<tool_call>{"name": "echo", "arguments": {"s": "hi"}}</tool_call>',
}


@pytest.mark.parametrize("template", [QWEN, LLAMA, None], ids=["hermes", "llama3", "tagged"])
def test_parallel_tool_calls_false_keeps_one_call_in_every_family(template):
    """parallel_tool_calls false is one call whatever the template family (Llama 3.1's
    `;`-separated calls once came back whole): in the whole reply and in the stream."""
    many = tools.parse_tools([ADD, ECHO], "auto", None, template)
    one = tools.parse_tools([ADD, ECHO], "auto", False, template)
    text = TWO_CALLS[many.fmt]
    assert [c.name for c in tools.parse_calls(text, many)[1]] == ["add", "echo"]
    content, calls = tools.parse_calls(text, one)
    assert content is None and [c.name for c in calls] == ["add"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    ch = fmt.Choice(0)
    ch.text = text
    out = fmt.chat_tool_chunk_choices(ch, None, "stop", False, one)
    assert {tc["index"] for c in out for tc in c["delta"].get("tool_calls", [])} == {0}
    assert out[-1]["finish_reason"] == "tool_calls"


def test_streamed_deltas_hold_the_tag_then_send_calls_as_openai_does():
    plan = tools.parse_tools([ADD], "auto", None, None)
    ch = fmt.Choice(0)
    out = []
    pieces = ["Let me ", "add. <tool", '_call>{"name": "add", ', '"arguments": {"a": 12345, "b": 678901234}}',
              "</tool_call>"]
    for i, piece in enumerate(pieces):
        ch.text += piece
        out += fmt.chat_tool_chunk_choices(ch, None, "stop" if i == len(pieces) - 1 else None, False, plan)
    deltas = [c["delta"] for c in out]
    assert deltas[0] == {"role": "assistant", "content": "Let me "}
    assert "".join(d.get("content", "") for d in deltas) == "Let me add. "  # no partial tag ever sent
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "add", "arguments": ""}
    assert len(rest) >= 2 and all(set(r) == {"index", "function"} for r in rest)
    assert json.loads("".join(r["function"]["arguments"] for r in rest)) == {"a": 12345, "b": 678901234}
    assert out[-1]["finish_reason"] == "tool_calls" and out[-1]["delta"] == {}


def test_prompts_per_family():
    history = [{"role": "user", "content": "1+1?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    body = ChatCompletionRequest(model="m", messages=history, tools=[ADD])
    plan = tools.parse_tools(body.tools, None, None, QWEN)
    messages, passed = chat_messages(body, plan, QWEN)
    assert passed[0]["function"]["name"] == "add"  # the template renders the tools itself
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 1}
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    plan = tools.parse_tools(body.tools, None, None, None)
    messages, passed = chat_messages(body, plan, None)
    assert passed is None and messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'


def test_compile_over_the_time_bound_is_a_400_and_a_hit_is_free(cache):
    _, tok = cache
    spec = StructuredOutput("json", json.dumps({"type": "object", "properties": {
        f"bound_{i}": {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]+$"} for i in range(40)}}))
    small = StructuredOutput("regex", "[0-9]{2}")

    async def go() -> tuple:
        slow, workers = GrammarWorkers(size=1, timeout=1e-6), GrammarWorkers(size=1)
        try:
            with pytest.raises(InvalidRequestError) as err:
                await compile_checked(slow, tok, spec, "response_format")
            first = await compile_checked(workers, tok, small, "guided_regex")
            again = await compile_checked(workers, tok, small, "guided_regex")
            return err, first, again
        finally:
            await slow.close()
            await workers.close()

    err, first, again = asyncio.run(go())
    assert err.value.code == "grammar_too_complex" and err.value.param == "response_format"
    assert not first.cache_hit and again.cache_hit and again.compile_ms == 0.0


@pytest.mark.parametrize("template", [QWEN, LLAMA, None])
def test_constrained_calls_stream_arguments_while_generated(template):
    plan = tools.parse_tools([ADD, ECHO], "required", None, template)
    if plan.fmt == "llama3":
        text = '{"name": "echo", "parameters": {"s": "a}b </tool_call> {x}"}}'
    else:
        nl = "\n" if plan.fmt == "hermes" else ""
        one = f'<tool_call>{nl}{{"name": "echo", "arguments": {{"s": "a}}b {{x}}"}}}}{nl}</tool_call>'
        text = one + "\n" + one.replace("echo", "add").replace('{"s": "a}b {x}"}', '{"a": 1, "b": 22}')
    ch, out = fmt.Choice(0), []
    for i in range(0, len(text), 3):  # a few characters per step, as tokens arrive
        ch.text = text[:i + 3]
        done = i + 3 >= len(text)
        out += fmt.chat_tool_chunk_choices(ch, None, "stop" if done else None, False, plan)
    calls: dict[int, dict] = {}
    before_end = 0
    for n, c in enumerate(out):
        for tc in c["delta"].get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"name": tc["function"]["name"], "args": ""}
            else:
                calls[tc["index"]]["args"] += tc["function"]["arguments"]
                before_end += n < len(out) - 3
    assert out[-1]["finish_reason"] == "tool_calls"
    assert before_end > 0  # arguments went out before the reply finished
    _, parsed = tools.parse_calls(text, plan)
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        [(p.name, json.loads(p.arguments)) for p in parsed]


def test_an_engine_error_finish_reason_never_reaches_the_client():
    """finish_reason "error" (a grammar failure in the engine) is no OpenAI value: it fails the
    request (an SSE error event or a 500) instead of appearing in a choice."""
    from tokenpath.errors import RequestFailedError
    from tokenpath.protocol.outputs import CompletionOutput, RequestOutput

    acc = fmt.Accumulator(n=1)
    out = RequestOutput(request_id="r", outputs=[CompletionOutput(index=0, text="a", token_ids=[1],
                                                                  finish_reason="error")],
                        prompt_token_ids=[1], num_cached_tokens=0, finished=True)
    with pytest.raises(RequestFailedError):
        acc.add(0, out)
