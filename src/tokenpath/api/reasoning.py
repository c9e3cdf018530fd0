"""Reasoning models: the `<think>...</think>` block split off the reply, and the template variables
that switch it (`chat_template_kwargs`, `reasoning_effort`).

The parser (vLLM's `--reasoning-parser` `qwen3` / `deepseek_r1`, one here since both write the same
tags) is chosen from the chat template: a template that mentions `<think>` is a reasoning model's.
`serve --reasoning-parser` overrides that (`none` turns it off). A reply is split into reasoning
(the text inside the block) and content (the text after it), for chat completions'
`reasoning_content` / `reasoning` and `usage.completion_tokens_details.reasoning_tokens`.

Where the prompt already ends inside an open block (DeepSeek-R1's templates add `<think>\\n` to the
generation prompt), the reply starts in reasoning and only its `</think>` is seen. A reply with no
block (Qwen3 with `enable_thinking: false`: the template writes an empty block into the prompt)
is all content. Only a block at the start of the reply counts, as the models write it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenpath.errors import InvalidRequestError

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# apply_chat_template's own arguments, and what the API passes itself: not template variables.
_RESERVED = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
             "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
             "return_assistant_tokens_mask", "tokenizer_kwargs", "chat_template", "tools_in_user_message"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def uses_reasoning(setting: str, chat_template: str | None) -> bool:
    """Whether replies are parsed for a think block: the serve setting, or `auto`: the template's."""
    if setting == "none":
        return False
    return setting != "auto" or OPEN in (chat_template or "")


@dataclass(frozen=True)
class Split:
    reasoning: str  # the reasoning safe to send so far
    content: str  # the content safe to send so far
    done: bool  # past the reasoning: what follows is content
    thought: bool  # a think block was opened (by the reply or the prompt)


@dataclass(frozen=True)
class ReasoningParser:
    starts_open: bool = False  # the prompt ended inside an open block

    def split(self, text: str, finished: bool) -> Split:
        """The reply so far as reasoning and content. Each grows as text is added (what streaming
        sends is always a prefix of the final split): a trailing prefix of a tag is held back
        until the reply goes on or finishes."""
        start = 0
        if not self.starts_open:
            head = text.lstrip()
            if not head.startswith(OPEN):
                if not finished and OPEN.startswith(head):  # (empty, or "<thi": not known yet)
                    return Split("", "", False, False)
                return Split("", text, True, False)
            start = len(text) - len(head) + len(OPEN)
        end = text.find(CLOSE, start)
        if end != -1:
            return Split(text[start:end].lstrip("\n"), text[end + len(CLOSE):].lstrip("\n"), True, True)
        body = text[start:]
        if not finished:
            for k in range(min(len(CLOSE) - 1, len(body)), 0, -1):
                if body.endswith(CLOSE[:k]):
                    body = body[:-k]
                    break
        return Split(body.lstrip("\n"), "", False, True)


def prompt_opens_block(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (DeepSeek-R1's templates)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


def known_variables(chat_template: str | None, variables: dict[str, Any]) -> dict[str, Any]:
    """Those of `variables` the template reads (an API's own switch, such as Anthropic's thinking
    off as Qwen3's `enable_thinking: false`, applied where it means something, silently)."""
    template = chat_template or ""
    return {k: v for k, v in variables.items() if re.search(rf"\b{re.escape(k)}\b", template)}


def template_variables(chat_template: str | None, kwargs: dict[str, Any] | None,
                       effort: str | None) -> tuple[dict[str, Any], list[str]]:
    """The variables to render the template with, from `chat_template_kwargs` and
    `reasoning_effort`, and the names of those the template never reads (ignored, named in the
    response header). A reserved name (the template call's own arguments) and a reasoning effort
    asked of a model that cannot reason are 400s naming them."""
    template = chat_template or ""
    out: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if not _IDENT.match(key) or key in _RESERVED:
            raise InvalidRequestError(f"{param} cannot be set: chat_template_kwargs keys are template variables "
                                      "(identifiers), not the template call's own arguments such as messages, "
                                      "tools or add_generation_prompt", param=param)
        if re.search(rf"\b{re.escape(key)}\b", template):
            out[key] = value
        else:
            ignored.append(param)
    if effort is None:
        return out, ignored
    if effort not in EFFORTS:
        raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
                                  param="reasoning_effort")
    if re.search(r"\breasoning_effort\b", template):
        out.setdefault("reasoning_effort", effort)
    elif re.search(r"\benable_thinking\b", template):
        # A hybrid model (Qwen3) has one switch: thinking on or off; the levels above "minimal" all mean on.
        out.setdefault("enable_thinking", effort not in ("none", "minimal"))
    elif effort in ("none", "minimal"):
        ignored.append("reasoning_effort")  # (a model that does not reason already reasons that little)
    else:
        raise InvalidRequestError(f"reasoning_effort {effort!r} cannot be honoured: this model's chat template has "
                                  "no reasoning (no reasoning_effort or enable_thinking variable); remove it, or "
                                  "send 'none'", param="reasoning_effort", code="unsupported_parameter")
    return out, ignored
