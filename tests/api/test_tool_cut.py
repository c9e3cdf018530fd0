"""A tool-call reply cut by max_tokens (issue 35 item 5): the calls written whole are kept, the cut
one is dropped, and no `<tool_call>` markup reaches `content`, whole or streamed, for `auto` and
`required` alike. The engine's deltas are fed through the real accumulator and formatting."""

from __future__ import annotations

import json

import pytest

from tokenpath.api import formatting as fmt
from tokenpath.api import tools
from tokenpath.protocol.outputs import CompletionOutput, RequestOutput
from tokenpath.telemetry.timeline import Timeline

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}
WHOLE = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
CUT = WHOLE + '\n<tool_call>{"name": "echo", "arguments": {"s": "hel'


def _deltas(text: str, prefix: str = "") -> list[RequestOutput]:
    full = prefix + text
    pieces = [full[i:i + 5] for i in range(0, len(full), 5)]
    return [RequestOutput("r", [CompletionOutput(0, p, [i], finish_reason="length" if i == len(pieces) - 1 else None)],
                          [1], 0, i == len(pieces) - 1) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("prefix", ["", "Let me add. "])
def test_cut_reply_keeps_whole_calls(choice, prefix):
    if choice == "required" and prefix:
        pytest.skip("required replies are calls only (the grammar)")
    plan = tools.parse_tools([ADD, ECHO], choice, None, None)
    acc = fmt.Accumulator(n=1)
    for out in _deltas(CUT, prefix):
        acc.add(0, out)
    body = fmt.chat_body("id", 0, "m", acc, False, Timeline("id"), plan)
    (c,) = body["choices"]
    assert c["finish_reason"] == "length"
    assert c["message"]["content"] == (prefix.strip() or None)
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_cut_reply_streamed_leaks_no_markup(choice):
    plan = tools.parse_tools([ADD, ECHO], choice, None, None)
    acc = fmt.Accumulator(n=1)
    content, args, reasons = "", {}, []
    for out in _deltas(CUT):
        for ch, c in acc.add(0, out):
            for x in fmt.chat_tool_chunk_choices(ch, c.logprobs, c.finish_reason, False, plan):
                content += x["delta"].get("content") or ""
                for tc in x["delta"].get("tool_calls", ()):
                    args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
                reasons.append(x["finish_reason"])
    assert "<tool_call" not in content and "</tool_call" not in content and content == ""
    assert json.loads(args[0]) == {"a": 2, "b": 3}
    assert reasons[-1] == "length"
    if choice == "auto":  # (held back until the reply ends: the cut call is never sent)
        assert list(args) == [0]


def test_llama3_cut_call_is_no_content():
    plan = tools.parse_tools([ADD], "auto", None, "<|python_tag|>")
    assert tools.parse_cut_calls('{"name": "add", "parameters": {"a": 1', plan) == (None, [])
