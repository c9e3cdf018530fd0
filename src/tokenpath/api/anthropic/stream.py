"""The chat stream's items -> Anthropic's Messages events, with SSE `event:` lines as Anthropic sends them.

`message_start` (the message with empty content and the prompt's token count) and a `ping`, then
per content block `content_block_start`, its deltas (`thinking_delta` for a reasoning model's
think block, then its `signature_delta`, `text_delta`, or `input_json_delta` for a tool call's input as it is generated),
`content_block_stop`; then `message_delta` (stop_reason,
stop_sequence, the whole usage) and `message_stop`. A failure mid-stream is an `error` event.
The chat stream already holds tool markup back and streams parsed calls (`formatting`), so text
and tool_use blocks map one to one onto its content and tool_call deltas.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable

from tokenpath.api.anthropic.errors import stream_error
from tokenpath.api.anthropic.signature import sign
from tokenpath.api.anthropic.translate import stop_reason, tool_use_id, usage
from tokenpath.api.formatting import Accumulator
from tokenpath.api.replies import Items


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """The open content block and the next block's index."""

    def __init__(self, key: Callable[[], bytes]) -> None:
        self.key = key
        self.thinking: list[str] = []  # the open thinking block's text, signed as it closes
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.tools: dict[int, int] = {}  # chat tool-call index -> block index

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # its signature last, as Anthropic sends it
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": sign(self.key(), "".join(self.thinking))}}))
            self.thinking = []
        self.open = None
        return out + [event("content_block_stop", {"index": self.index})]

    def start(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]


async def message_events(items: Items, acc: Accumulator, stops: list[str] | None,
                         key: Callable[[], bytes]) -> AsyncIterator[bytes]:
    blocks = _Blocks(key)
    started = False
    finish: str | None = None

    def start(chunk: dict) -> list[bytes]:
        message: dict[str, object] = {
            "id": chunk.get("id"), "type": "message", "role": "assistant", "model": chunk.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage(acc), "output_tokens": 0}}
        return [event("message_start", {"message": message}), event("ping", {})]

    async for item in items:
        if isinstance(item, str):  # DONE
            continue
        if "error" in item and "choices" not in item:
            if started:
                for b in blocks.close():
                    yield b
            yield event("error", {k: v for k, v in stream_error(item).items() if k != "type"})
            return
        if not started:
            started = True
            for b in start(item):
                yield b
        for choice in item.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):  # a reasoning model's think block (api/reasoning.py)
                if blocks.open != "thinking":
                    for b in blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield b
                blocks.thinking.append(delta["reasoning_content"])
                yield event("content_block_delta", {"index": blocks.index, "delta": {
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                if blocks.open != "text":
                    for b in blocks.start("text", {"type": "text", "text": ""}):
                        yield b
                yield event("content_block_delta", {"index": blocks.index,
                                                    "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or ():
                if "id" in call:
                    fn = call.get("function") or {}
                    for b in blocks.start("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                       "name": fn.get("name"), "input": {}}):
                        yield b
                    blocks.tools[call.get("index", 0)] = blocks.index
                args = (call.get("function") or {}).get("arguments")
                if args:
                    yield event("content_block_delta", {"index": blocks.tools.get(call.get("index", 0), blocks.index),
                                                        "delta": {"type": "input_json_delta", "partial_json": args}})
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not started:
        for b in start({"id": f"msg_{uuid.uuid4().hex}", "model": ""}):  # (no chunk at all: never seen)
            yield b
    for b in blocks.close():
        yield b
    reason, sequence = stop_reason(finish, acc, stops)
    # The whole usage, as Anthropic's message_delta now carries it: LangChain's ChatAnthropic reads
    # the prompt's count here, not from message_start (without it a stream reported 0 input tokens).
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(acc)})
    yield event("message_stop", {})
