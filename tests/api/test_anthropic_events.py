"""The Messages stream writer on its own: each event the chat stream can end with, an error
included, is one the `anthropic` SDK's own accumulator accepts (the server tests cannot make an
engine fail mid-stream on demand)."""

from __future__ import annotations

import json

from anthropic.lib.streaming._messages import accumulate_event

from tokenpath.api.anthropic.signature import sign
from tokenpath.api.anthropic.stream import message_events
from tokenpath.api.formatting import Accumulator
from tokenpath.api.sse import DONE
from tokenpath.protocol.outputs import CompletionOutput, RequestOutput


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "msg_1", "object": "chat.completion.chunk", "created": 0, "model": "m", "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


async def _events(items: list) -> list[tuple[str, dict]]:
    acc = Accumulator(n=1)
    acc.add(0, RequestOutput("r", [CompletionOutput(0, "Hi", [1, 2], finish_reason="stop", stop_reason="END")],
                             prompt_token_ids=list(range(7)), num_cached_tokens=0, finished=True))

    async def source():
        for item in items:
            yield item

    out = []
    async for raw in message_events(source(), acc, ["END"], key=lambda: b"k"):
        head, data = raw.decode().rstrip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_text_and_tool_use_blocks_accumulate_in_the_sdk():
    events = await _events([
        _chunk({"role": "assistant", "content": "Hi"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, "tool_calls"), DONE])
    names = [e for e, _ in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    snapshot, bufs = None, {}
    for name, data in events:
        assert data["type"] == name
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.input_tokens == 7
    assert snapshot.usage.output_tokens == 2
    assert [b.type for b in snapshot.content] == ["text", "tool_use"]
    assert snapshot.content[1].id == "toolu_abc" and snapshot.content[1].input == {"a": 1}


async def test_stop_sequence_and_error_events():
    events = await _events([_chunk({"role": "assistant", "content": "Hi"}, "stop"), DONE])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    failed = await _events([_chunk({"role": "assistant", "content": "Hi"}),
                            {"error": {"message": "replica gone", "type": "service_unavailable", "param": None,
                                       "code": "x"}}, DONE])
    assert [e for e, _ in failed][-2:] == ["content_block_stop", "error"]
    assert failed[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "replica gone"}}


async def test_thinking_block_ends_with_its_signature():
    events = await _events([_chunk({"role": "assistant", "reasoning_content": "Hm, "}),
                            _chunk({"reasoning_content": "blue."}), _chunk({"content": "Blue."}, "stop"), DONE])
    deltas = [d["delta"]["type"] for e, d in events if e == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta"]
    snapshot, bufs = None, {}
    for _, data in events:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text"]
    assert snapshot.content[0].thinking == "Hm, blue." and snapshot.content[0].signature == sign(b"k", "Hm, blue.")
