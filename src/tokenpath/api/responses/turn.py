"""One Responses API turn: the response object it answers with, and its stored record.

The stored record is the response and its whole conversation input (an earlier chain's input
and output, then this request's input), so `previous_response_id` is one read: the next turn
prepends `input + output` of the record it names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from tokenpath.api.responses.schemas import ResponsesRequest
from tokenpath.api.responses.translate import new_id
from tokenpath.gateway.responses_store import ResponseStore

log = logging.getLogger("tokenpath.api")


def conversation_bytes(items: list[dict]) -> int:
    return len(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode())


def usage(chat_usage: dict) -> dict:
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A reasoning model's think block (api/reasoning.py) as OpenAI's reasoning item: the text as
    `reasoning_text` content (as vLLM serves it), no summary."""
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_of(message: dict) -> list[dict]:
    """A finished chat message (`formatting.chat_body`'s) as output items."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(message["content"]))
    for c in message.get("tool_calls") or ():
        out.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return out or [message_item("")]  # (an empty reply is still one message, as OpenAI answers it)


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) for the reply's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", {"reason": "interrupted"}
    return "completed", None


@dataclass
class Turn:
    req: ResponsesRequest
    items: list[dict]  # the conversation's input: the chain's turns, then this request's input
    store: ResponseStore | None  # None: this response is not stored (store false, or the operator's switch)
    tenant: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, model: str, status: str, output: list[dict], chat_usage: dict | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        r = self.req
        tools = [{**t, "strict": t.get("strict", True)} for t in r.tools or ()]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None}, "service_tier": "default",
            "store": self.store is not None,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": r.tool_choice or "auto", "tools": tools,
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": r.truncation or "disabled",
            "usage": usage(chat_usage) if chat_usage else None, "user": r.user, "metadata": r.metadata or {},
        }

    async def save(self, response: dict) -> None:
        """Store the finished response (before the client is told it is complete, so the next turn
        of a chain finds it). A store that fails is logged: the reply itself is still good."""
        if self.store is None or response["status"] == "failed":
            return
        record = {"response": response, "input": self.items}
        try:
            await asyncio.to_thread(self.store.put, self.id, self.tenant, time.time(), record)
        except Exception:
            log.exception("could not store response %s", self.id)
