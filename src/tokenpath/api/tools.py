"""Tool calling: OpenAI's `tools` / `tool_choice` -> the prompt, an output constraint, and parsed calls.

The model writes calls in its family's own format, chosen from its chat template:

- `hermes` (Qwen2.5, Qwen3, Hermes: the template mentions `<tool_call>`): each call is
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; the template gets `tools=`.
- `llama3` (Llama 3.1+: the template mentions `<|python_tag|>` or `ipython`): one JSON object
  `{"name": ..., "parameters": {...}}`; the template gets `tools=`.
- `tagged`, for templates that know no tools (SmolLM2, the default model): tokenpath's documented
  format. The tool list goes into the system message as JSON with an instruction, and the model
  replies `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one per call, as Hermes
  does); past calls in the history are rendered the same way and tool results as `tool` turns.

`tool_choice` `required` and a named function constrain decoding with a Lark grammar whose JSON
part is the tools' parameter schemas, so the output always parses; `auto` parses what the model
wrote (text that does not parse as a call stays content); `none` sends the tools but parses
nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenpath.api.structured import check_schema
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import PARALLEL_CALLS, SPEC_BYTES, TOOL_NAME_CHARS, TOOLS, TOOLS_CHARS
from tokenpath.protocol.sampling_params import StructuredOutput

_NAME = re.compile(rf"^[A-Za-z0-9_.-]{{1,{TOOL_NAME_CHARS.value}}}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this model: how to render, constrain and parse."""

    tools: list[Tool]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool
    fmt: str  # "hermes" | "llama3" | "tagged"
    checks: tuple[tuple[str, str], ...] = ()  # (param, schema text): for the grammar worker's meta-validation

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]


def template_format(chat_template: str | None) -> str:
    t = chat_template or ""
    if OPEN in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "tagged"


def parse_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
                chat_template: str | None) -> ToolPlan | None:
    """Checks the tool list (size, names, parameter schemas) and `tool_choice`; None without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools; send the tools or remove tool_choice")
        return None
    if len(tools) > TOOLS.value:
        raise _bad("tools", f"tools has {len(tools)} entries, over the limit of {TOOLS.value}")
    size = len(json.dumps(tools, ensure_ascii=False))
    if size > TOOLS_CHARS.value:
        raise _bad("tools", f"tools is {size} characters, over the limit of {TOOLS_CHARS.value}; send fewer or "
                   "smaller tool definitions")
    parsed: list[Tool] = []
    checks: list[tuple[str, str]] = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", f"{where}.function.name must be 1-{TOOL_NAME_CHARS.value} letters, "
                       f"digits, '_', '.' or '-', got {name!r}")
        if any(p.name == name for p in parsed):
            raise _bad(f"{where}.function.name", f"tool name {name!r} is defined twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"{where}.function.parameters", checks)
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"{where}.function.description", f"{where}.function.description must be a string")
        parsed.append(Tool(name, desc, params))
    choice, named = "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                       f"{tool_choice!r}")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if all(t.name != name for t in parsed):
            raise _bad("tool_choice", f"tool_choice names the function {name!r}, which is not in tools (known: "
                       f"{', '.join(t.name for t in parsed)})")
        choice, named = "named", name
    return ToolPlan(parsed, choice, named, parallel is not False, template_format(chat_template), tuple(checks))


# -- constraint ---------------------------------------------------------------------------------
def _call_schema(tool: Tool, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
            "required": ["name", args_key], "additionalProperties": False}


def constraint(plan: ToolPlan) -> StructuredOutput | None:
    """For `required` and a named function: a grammar the calls always parse under."""
    if plan.choice not in ("required", "named"):
        return None
    tools = [t for t in plan.tools if plan.choice == "required" or t.name == plan.named]
    args_key = "parameters" if plan.fmt == "llama3" else "arguments"
    alts = [_call_schema(t, args_key) for t in tools]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    obj = "%json " + json.dumps(schema, ensure_ascii=False)
    many = plan.parallel and plan.choice == "required"
    if plan.fmt == "llama3":
        lark = f"start: call\ncall: {obj}\n"
    else:
        sep = ' "\\n" ' if plan.fmt == "hermes" else " "
        # A bounded number of parallel calls (one per tool, at least 2, at most PARALLEL_CALLS.value): a small
        # model may otherwise repeat calls until max_tokens cuts the last one off.
        most = min(PARALLEL_CALLS.value, max(2, len(tools)))
        start = 'call ("\\n" call){0,' + str(most - 1) + '}' if many else "call"
        lark = f'start: {start}\ncall: "{OPEN}"{sep}{obj}{sep}"{CLOSE}"\n'
    if len(lark) > 4 * SPEC_BYTES.value:
        raise _bad("tools", "the tools' parameter schemas are too large to constrain; send fewer tools")
    return StructuredOutput("grammar", lark, tools=True)


# -- prompt -------------------------------------------------------------------------------------
def tagged_system_prompt(plan: ToolPlan) -> str:
    listing = json.dumps(plan.template_tools(), ensure_ascii=False)
    return ("You can call functions. The available functions, as JSON:\n" + listing + "\nTo call a function, "
            f"reply with {OPEN}{{\"name\": <function name>, \"arguments\": <arguments object>}}{CLOSE}, one per call, "
            "and nothing else. Otherwise, reply normally.")


def render_call_text(calls: list[dict], fmt: str) -> str:
    """Past assistant calls as the text the model would have written (templates without tools)."""
    out = []
    for c in calls:
        fn = c["function"]
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        out.append(OPEN + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + CLOSE)
    return "\n".join(out)


def check_history_calls(calls: list[dict], where: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked: each an id, type function, a name and JSON
    arguments. Returns them with `arguments` parsed to objects (templates iterate over them)."""
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls.{j}"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(at, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise _bad(f"{at}.id", f"{at}.id must be a non-empty string")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{at}.function.name", f"{at}.function.name must be a non-empty string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise _bad(f"{at}.function.arguments", f"{at}.function.arguments must be a JSON string, got "
                           f"{fn['arguments'][:80]!r}") from None
        if not isinstance(args, dict):
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments must encode a JSON object")
        out.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# -- parsing ------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d: dict = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


_TAGGED = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


def _call(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output. Anything that is not a well-formed call of a known
    tool stays content: `auto` never invents a call. With `parallel_tool_calls` false only the
    first call is kept, as OpenAI makes it; cut here, after the family's parser, so that every
    format (and every caller: whole replies, cut replies, streams) obeys it alike."""
    content, calls = _parse_family(text, plan)
    if not plan.parallel:
        calls = calls[:1]
    return content, calls


def _parse_family(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, every call) in the plan's format: Llama 3's `;`-separated JSON objects or the
    tagged/Hermes `<tool_call>` blocks."""
    names = {t.name for t in plan.tools}
    if plan.fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            objs: list[Any] = []
            for part in body.split(";"):
                try:
                    objs.append(json.loads(part))
                except ValueError:
                    return text, []
            found = [_call(o, names) for o in objs]
            whole = [c for c in found if c is not None]
            if whole and len(whole) == len(found):  # every part a well-formed call, or none is one
                return None, whole
        return text, []
    calls: list[ParsedCall] = []
    content = text
    for m in _TAGGED.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            return text, []  # one malformed call: the whole reply is content, as written
        calls.append(call)
        content = content.replace(m.group(0), "", 1)
    if not calls:
        return text, []
    content = content.strip()
    return content or None, calls


def parse_cut_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a reply cut short (max_tokens): the calls written whole are kept, the
    one cut off is dropped, and no call markup, whole or cut, is ever left in the content: the
    content is the text before the first call."""
    start = call_start(text, plan)
    if start == -1:
        return text, []
    content = text[:start].strip() or None
    if plan.fmt == "llama3":
        return content, []  # (one JSON object: cut, it is no call)
    head = text[start:]
    whole = head[:head.rfind(CLOSE) + len(CLOSE)] if CLOSE in head else ""
    calls = parse_calls(whole, plan)[1] if whole else []
    return content, calls


def call_start(text: str, plan: ToolPlan) -> int:
    """Where a (possible) call starts in streamed text, or -1: text before it can be sent as
    content; from there on it is held back until the call parses. A trailing prefix of the open
    tag counts, so no partial tag ever reaches the client."""
    if plan.fmt == "llama3":
        stripped = text.lstrip()
        if stripped.startswith(("{", "<|python_tag|>")) or (stripped and "<|python_tag|>".startswith(stripped)):
            return len(text) - len(stripped)
        return -1 if stripped or not text else 0
    i = text.find(OPEN)
    if i != -1:
        return i
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return -1


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def streamed_calls(text: str, plan: ToolPlan, finished: bool) -> list[tuple[str, str]]:
    """(name, arguments so far) of each call in a *constrained* reply as it is being written, for
    streaming arguments while they are generated. The grammar fixed the shape (`{"name": ...,
    "arguments": ...}`, compact), so the name is known once its string closes, and the arguments
    text sent is always a prefix of the final one: an open call holds back its last
    len(CLOSE) + 1 characters and any trailing braces, which may be the call's own end."""
    if plan.fmt == "llama3":
        body = text.lstrip().removeprefix("<|python_tag|>")
        bodies = [(body, finished)]
    else:
        bodies = []
        for seg in text.split(OPEN)[1:]:
            end = seg.find(CLOSE)
            bodies.append((seg, False) if end == -1 else (seg[:end], True))
        if finished and bodies:
            bodies[-1] = (bodies[-1][0], True)
    out = []
    for body, closed in bodies:
        m = _HEAD.match(body)
        if m is None:
            break
        args = body[m.end():]
        if closed:
            args = args.rstrip().removesuffix("}").rstrip()
        else:
            args = args[:max(0, len(args) - len(CLOSE) - 1)].rstrip("} \n\t")
        out.append((json.loads('"' + m.group(1) + '"'), args))
    return out
