"""Responses API items <-> the chat messages the pipeline runs, and a finished reply -> a response.

Input items: `message` (role user/assistant/system/developer; content a string or `input_text` /
`output_text` parts), `function_call`, `function_call_output`, and `reasoning` (a past turn's:
its `reasoning_text` content becomes the `reasoning_content` of the assistant turn that follows it,
which a template that knows it renders, as Qwen3's does after the last user query, so a tool-use
loop goes on with its reasoning; any other template ignores it). Consecutive function calls
become one assistant message's `tool_calls`; an output becomes a `tool` message. Every malformed
item is a 400 naming it (`input.3.call_id`); images, files and audio are refused by name.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import ValidationError

from tokenpath.api.responses.schemas import ResponsesRequest, unsupported
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.errors import InvalidRequestError, TokenpathError

_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text"}
_REFUSED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
# Items an OpenAI-hosted model makes that have no meaning here, refused by their type.
_HOSTED = {"web_search_call", "file_search_call", "computer_call", "computer_call_output",
           "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
           "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "item_reference",
           "custom_tool_call", "custom_tool_call_output", "shell_call", "apply_patch_call"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def input_items(value: str | list[dict[str, Any]]) -> list[dict]:
    """`input` as a list of items (a string is one user message), each checked."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    for i, item in enumerate(value):
        _check_item(item, f"input.{i}")
    return [dict(item) for item in value]


def stored_item(item: dict) -> dict:
    """An input item as OpenAI lists it (`input_items`): an id, a type, and a message's content as
    parts (`input_text`; `output_text` for an assistant's)."""
    kind = item.get("type", "message")
    out = {"id": item.get("id") or new_id("msg" if kind == "message" else "item"), "type": kind, **item}
    if kind == "message" and isinstance(out["content"], str):
        part = "output_text" if out["role"] == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"], **({"annotations": []} if part == "output_text"
                                                                    else {})}]
    if kind in ("message", "function_call", "function_call_output"):
        out.setdefault("status", "completed")
    return out


def _part_text(part: Any, at: str) -> str:
    if not isinstance(part, dict):
        raise _bad(at, f"{at} must be a content part object such as {{\"type\": \"input_text\", \"text\": ...}}")
    kind = part.get("type")
    if kind in _REFUSED_PARTS:
        raise InvalidRequestError(f"{at}: {_REFUSED_PARTS[kind]} inputs ({kind}) are not supported by this model; "
                                  "send input_text parts only", param=at, code="unsupported_content")
    if kind == "refusal":
        return str(part.get("refusal") or "")
    if kind not in _TEXT_PARTS:
        raise _bad(f"{at}.type", f"{at}.type {kind!r} is not a known content part type; use 'input_text'")
    if not isinstance(part.get("text"), str):
        raise _bad(f"{at}.text", f"{at}.text must be a string")
    return part["text"]


def _content_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(at, f"{at} must be a string or a list of input_text parts")
    return "".join(_part_text(p, f"{at}.{j}") for j, p in enumerate(content))


def _check_item(item: Any, at: str) -> None:
    if not isinstance(item, dict):
        raise _bad(at, f"{at} must be an item object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise _bad(f"{at}.role", f"{at}.role must be one of user, assistant, system, developer; got "
                       f"{item.get('role')!r}")
        if "content" not in item:
            raise _bad(f"{at}.content", f"Missing required parameter: '{at}.content'")
        _content_text(item["content"], f"{at}.content")
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
                raise _bad(f"{at}.{name}", f"{at}.{name} must be a non-empty string")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            raise _bad(f"{at}.call_id", f"{at}.call_id must be the call_id of the function_call it answers")
        if "output" not in item:
            raise _bad(f"{at}.output", f"Missing required parameter: '{at}.output'")
        _content_text(item["output"], f"{at}.output")
    elif kind == "reasoning":  # a past reasoning item, sent back as the SDKs do
        if not isinstance(item.get("summary", []), list):
            raise _bad(f"{at}.summary", f"{at}.summary must be a list of summary_text parts")
        _reasoning_text(item, at)
    elif kind in _HOSTED:
        raise InvalidRequestError(f"{at}.type {kind!r} items are not supported by this server; send message, "
                                  "function_call and function_call_output items", param=f"{at}.type",
                                  code="unsupported_parameter")
    else:
        raise _bad(f"{at}.type", f"{at}.type {kind!r} is not a known item type; use 'message', 'function_call' "
                   "or 'function_call_output'")


def _reasoning_text(item: dict, at: str) -> str:
    """A reasoning item's text: its `reasoning_text` content parts (as vLLM and this server write
    them), joined; "" without content (a summary is not the reasoning, and encrypted content is
    another server's)."""
    content = item.get("content")
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad(f"{at}.content", f"{at}.content must be a list of reasoning_text parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{at}.content.{j}"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise _bad(where, f"{where} must be a reasoning_text part {{\"type\": \"reasoning_text\", \"text\": ...}}")
        texts.append(part["text"])
    return "\n\n".join(texts)


class Origins:
    """Where each chat message (and each of its tool calls) came from in the Responses request, so a
    pipeline error about `messages.4.tool_calls.1.function.arguments` names `input.6.arguments`."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.calls: list[list[str]] = []

    def add(self, where: str) -> None:
        self.messages.append(where)
        self.calls.append([])


def chat_messages(items: list[dict], instructions: str | None, names: list[str] | None = None,
                  origins: Origins | None = None) -> list[dict]:
    """The conversation as chat messages (items already checked by `input_items`). `names`: each
    item's parameter path (default `input.N`), recorded per message into `origins`."""
    origins = origins if origins is not None else Origins()
    names = names or [f"input.{i}" for i in range(len(items))]
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.add("instructions")
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for item, where in zip(items, names, strict=True):
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = "\n\n".join(x for x in (thought, _reasoning_text(item, where)) if x)
            continue
        if kind == "message":
            messages.append({"role": item["role"], "content": _content_text(item["content"], where)})
            origins.add(where)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" not in last and not last["content"]:
                last["tool_calls"], last["content"] = [call], None
            elif last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.add(where)
            origins.calls[-1].append(where)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content_text(item["output"], where)})
            origins.add(where)
        if thought and messages[-1]["role"] == "assistant" and not messages[-1].get("reasoning_content"):
            messages[-1]["reasoning_content"] = thought
        thought = ""  # (reasoning not followed by its assistant turn: nothing renders it)
    return messages


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        at = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequestError(f"{at}.type {kind!r} is not supported by this server: only function tools "
                                      "run here", param=f"{at}.type", code="unsupported_parameter")
        if "function" in t:
            raise _bad(f"{at}.function", f"{at}: the Responses API takes name, description and parameters on "
                       "the tool itself, not under 'function'")
        if not isinstance(t.get("name"), str):
            raise _bad(f"{at}.name", f"Missing required parameter: '{at}.name'")
        fn: dict = {"name": t["name"]}
        for key in ("description", "parameters"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
                              f"...}}; {choice.get('type')!r} is not supported here", param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    if not text:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "text.format must be an object such as {\"type\": \"json_schema\", ...}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "text.format.schema must be a JSON Schema object")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type", f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completions request the pipeline runs for this Responses request."""
    if req.text is not None and set(req.text) - {"format", "verbosity"}:
        extra = sorted(set(req.text) - {"format", "verbosity"})[0]
        raise _bad(f"text.{extra}", f"unrecognized request argument supplied: text.{extra}")
    if req.text is not None and req.text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "other than 'medium' is not supported by this model")
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "stream": req.stream, "user": req.user,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequestError(f"input: {first.get('msg')}", param="input") from None


# -- pipeline errors named in this API's fields -------------------------------------------------
_RENAMES = [(re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
            (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
            (re.compile(r"\bmessages\b"), "input")]
_CALL = re.compile(r"\bmessages\.(\d+)\.tool_calls\.(\d+)(?:\.function)?(?:\.(\w+))?")
_MESSAGE = re.compile(r"\bmessages\.(\d+)")


def rename(exc: Exception, origins: Origins | None = None) -> Exception:
    """A pipeline error that names a chat field (`max_tokens`, `response_format`, `messages.3`)
    names the Responses field instead (`max_output_tokens`, `text.format`, `input.5`)."""
    if not isinstance(exc, TokenpathError):
        return exc

    def call(m: re.Match) -> str:
        n, k = int(m.group(1)), int(m.group(2))
        if origins is None or n >= len(origins.calls) or k >= len(origins.calls[n]):
            return m.group(0)
        return origins.calls[n][k] + ("." + m.group(3) if m.group(3) else "")

    def message(m: re.Match) -> str:
        n = int(m.group(1))
        return origins.messages[n] if origins is not None and n < len(origins.messages) else "input"

    for text in ("message", "param"):
        value = getattr(exc, text)
        if not value:
            continue
        value = _CALL.sub(call, value)
        value = _MESSAGE.sub(message, value)
        for pattern, to in _RENAMES:
            value = pattern.sub(to, value)
        setattr(exc, text, value)
    exc.args = (exc.message,)
    return exc
