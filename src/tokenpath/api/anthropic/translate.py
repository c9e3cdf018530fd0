"""A Messages body -> the internal chat completion request; a finished chat body -> a Message.

Blocks map onto what the chat pipeline already knows: `text` is text, an assistant's `tool_use`
is a past tool call (its `input` the arguments), a user's `tool_result` is a `tool` message
answering that call. `thinking` blocks in the history, once their signature is checked
(`signature.py`), become the assistant turn's `reasoning_content`, which a template that knows it
renders (Qwen3 writes it inside `<think>` for the turns after the last user query: a tool-use loop
goes on with its reasoning, as Anthropic's and vLLM's do) and any other ignores; `redacted_thinking`
blocks (opaque to this server) are dropped;
`image` and `document` blocks are refused by name. `tools` become function tools (their
`input_schema` the parameters) and `tool_choice` maps `auto`/`any`/`tool`/`none` onto
`auto`/`required`/a named function/`none`, so `any` and `tool` go through the tool grammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from tokenpath.api.anthropic.schemas import CountTokensRequest, MessageParam, MessagesRequest
from tokenpath.api.anthropic.signature import sign
from tokenpath.api.formatting import Accumulator
from tokenpath.api.schemas import ChatCompletionRequest, ChatMessage
from tokenpath.errors import InvalidRequestError

_UNSUPPORTED_BLOCKS = {"image": "image", "document": "document", "search_result": "search result",
                       "container_upload": "container upload"}
THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _unsupported(at: str, kind: str, hint: str = "") -> InvalidRequestError:
    """A block type Anthropic has and this model cannot take (`_UNSUPPORTED_BLOCKS`), refused by name."""
    return InvalidRequestError(f"{at}: {_UNSUPPORTED_BLOCKS[kind]} blocks are not supported by this model{hint}",
                               param=at, code="unsupported_content")


def _typed(blocks: list, where: str) -> Iterator[tuple[str, Any, Any]]:
    """Each block with its path (`where.j`, the error's param) and its type (None when the block is
    not an object), for the three readers of a block list to dispatch on."""
    for j, b in enumerate(blocks):
        yield f"{where}.{j}", (b.get("type") if isinstance(b, dict) else None), b


def _text_of(blocks: Any, where: str) -> str:
    """A `system` or `tool_result.content`: a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, "must be a string or a list of text blocks")
    out = []
    for at, kind, b in _typed(blocks, where):
        if kind in _UNSUPPORTED_BLOCKS:
            raise _unsupported(at, kind, "; send text blocks")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise _bad(at, "must be a text block {\"type\": \"text\", \"text\": ...}")
        out.append(b["text"])
    return "\n".join(out)


def _blocks(m: MessageParam) -> list[dict]:
    return [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content


def _assistant(m: MessageParam, where: str) -> tuple[ChatMessage, list[str]]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict] = []
    for at, kind, b in _typed(_blocks(m), f"{where}.content"):
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not b["id"]:
                raise _bad(f"{at}.id", "must be a non-empty string")
            if not isinstance(b.get("name"), str) or not b["name"]:
                raise _bad(f"{at}.name", "must be a non-empty string")
            if not isinstance(b.get("input"), dict):
                raise _bad(f"{at}.input", "must be an object")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "thinking":  # (its text and signature checked by signature.check_history)
            if not isinstance(b.get("thinking"), str):
                raise _bad(f"{at}.thinking", "must be a string")
            thoughts.append(b["thinking"])
        elif kind == "redacted_thinking":  # (encrypted by Anthropic: nothing here can read it)
            continue
        elif kind in _UNSUPPORTED_BLOCKS:
            raise _unsupported(at, kind)
        else:
            raise _bad(f"{at}.type", f"{kind!r} is not a block an assistant message may carry here; use 'text' "
                       "or 'tool_use'")
    msg = ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                      tool_calls=calls or None, reasoning_content="\n\n".join(thoughts) or None)
    return msg, [c["id"] for c in calls]


def _user(m: MessageParam, where: str, pending: list[str]) -> list[ChatMessage]:
    """A user turn: its tool results first (as `tool` messages), then its text."""
    results: list[ChatMessage] = []
    texts: list[str] = []
    for at, kind, b in _typed(_blocks(m), f"{where}.content"):
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            use_id = b.get("tool_use_id")
            if use_id not in pending:
                raise _bad(f"{at}.tool_use_id", f"{use_id!r} does not answer a tool_use block of the previous "
                           f"assistant message (its ids: {pending or 'none'})")
            pending.remove(use_id)
            text = _text_of(b.get("content", ""), f"{at}.content")
            if b.get("is_error"):
                text = "Error: " + text
            results.append(ChatMessage(role="tool", tool_call_id=use_id, content=text))
        elif kind in _UNSUPPORTED_BLOCKS:
            raise _unsupported(at, kind, "; send text blocks")
        else:
            raise _bad(f"{at}.type", f"{kind!r} is not a block a user message may carry here; use 'text' or "
                       "'tool_result'")
    if pending:
        raise _bad(f"{where}.content", f"tool_use ids {pending} of the previous assistant message have no "
                   "tool_result block; answer each call first")
    return results + ([ChatMessage(role="user", content="\n".join(texts))] if texts or not results else [])


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """The conversation in chat form; role order as Anthropic requires it: it starts with a user
    turn, every tool_use is answered by the next user turn, and it ends with a user turn."""
    if not body.messages:
        raise _bad("messages", "must contain at least one message")
    out: list[ChatMessage] = []
    if body.system:
        out.append(ChatMessage(role="system", content=_text_of(body.system, "system")))
    if body.messages[0].role != "user":
        raise _bad("messages.0.role", "the first message must use the 'user' role")
    pending: list[str] = []
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if m.role == "assistant":
            if pending:
                raise _bad(f"{where}.role", f"tool_use ids {pending} must be answered by a user message with "
                           "tool_result blocks before the next assistant message")
            msg, pending = _assistant(m, where)
            out.append(msg)
        else:
            out.extend(_user(m, where, pending))
    if body.messages[-1].role != "user":
        last = len(body.messages) - 1
        raise _bad(f"messages.{last}.role", "the last message must use the 'user' role: continuing a "
                   "prefilled assistant turn is not supported by this server")
    return out


def _tools(body: CountTokensRequest) -> tuple[list[dict] | None, Any, bool | None]:
    """(OpenAI tools, tool_choice, parallel_tool_calls)."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            at = f"tools.{i}"
            if not isinstance(t, dict):
                raise _bad(at, "must be an object with name and input_schema")
            kind = t.get("type")
            if kind not in (None, "custom"):
                raise InvalidRequestError(f"{at}.type: {kind!r} (an Anthropic server tool) is not supported by this "
                                          "server; send custom tools with name and input_schema",
                                          param=f"{at}.type", code="unsupported_parameter")
            extra = set(t) - {"type", "name", "description", "input_schema", "cache_control"}
            if extra:
                raise _bad(f"{at}.{sorted(extra)[0]}", "is not a known tool field")
            if not isinstance(t.get("input_schema"), dict):
                raise _bad(f"{at}.input_schema", "is required: the JSON schema of the tool's input")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    tc = body.tool_choice
    if tc is None:
        return tools, None, None
    kind = tc.get("type")
    parallel = False if tc.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return tools, "auto", parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", parallel
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise _bad("tool_choice.name", "is required with type 'tool': the name of the tool to call")
        return tools, {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise _bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def thinking(body: CountTokensRequest) -> tuple[bool, int | None]:
    """(whether the request asks for thinking, its budget in tokens), `thinking` checked. A
    reasoning model answers with `thinking` blocks and its think block is closed after the
    budget (`api/thinking.py`); a model without reasoning names `thinking` in x-tokenpath-ignored."""
    t = body.thinking
    if t is None:
        return False, None
    kind = t.get("type")
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    budget = t.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise _bad("thinking.budget_tokens", "is required with type 'enabled': a positive integer")
    forced = (body.tool_choice or {}).get("type") in ("any", "tool")
    if kind != "disabled" and forced:  # (as Anthropic refuses it: a grammar would decide the thinking too)
        raise _bad("thinking", "thinking may not be enabled when tool_choice forces tool use ('any' or 'tool'): "
                   "the tool grammar decides every token, the think block's included, so no budget or "
                   "thinking could be honoured; use tool_choice 'auto' or 'none', or thinking 'disabled'")
    return kind != "disabled", budget if kind == "enabled" else None


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request this Messages (or count_tokens) body asks for."""
    thinking(body)
    tools, choice, parallel = _tools(body)
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), "tools": tools,
                              "tool_choice": choice, "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k or None, stop=body.stop_sequences, stream=body.stream,
                      user=body.metadata.user_id if body.metadata else None)
    return ChatCompletionRequest(**fields)


# -- the response ---------------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    """tokenpath's `call_<hex>` call ids as Anthropic spells them (`toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: str | None, acc: Accumulator, stops: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason. An aborted reply (server shutdown)
    has no Anthropic reason: null."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop":
        matched = next((c.stop_reason for c in acc.sorted() if isinstance(c.stop_reason, str)), None)
        if matched is not None and matched in (stops or ()):
            return "stop_sequence", matched
        return "end_turn", None
    return None, None


def usage(acc: Accumulator) -> dict:
    return {"input_tokens": sum(acc.prompt_tokens.values()), "output_tokens": acc.completion_tokens}


def message_body(chat: dict, acc: Accumulator, stops: list[str] | None, key: Callable[[], bytes]) -> dict:
    """A finished chat completion body as Anthropic's Message (a thinking block signed with `key`)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):  # (a reasoning model's think block: api/reasoning.py)
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": sign(key(), msg["reasoning_content"])})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], acc, stops)
    return {"id": chat["id"], "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(acc)}
