"""Each entry of the limits table (`tokenpath.protocol.limits.TABLE`) is enforced: a request just
over it is refused with the entry's status and an error naming the entry's `param`, by the real
check that enforces it (the schema through the app's own validation-error mapping, `check_fields`,
the structured-output and tool checks, `SamplingParams`, the body-limit middleware). No server:
these run in the fast tier. A new entry without a probe here fails `test_every_entry_has_a_probe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from tokenpath.api.errors import validation_error
from tokenpath.api.inputs import check_fields, check_request_tokens, embedding_inputs
from tokenpath.api.limits import BodyLimitMiddleware
from tokenpath.api.responses.handler import _load
from tokenpath.api.responses.schemas import ResponsesRequest
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenpath.api.settings import Caps
from tokenpath.api.spec_limits import check_json_shape, check_regex
from tokenpath.api.structured import check_schema, requested
from tokenpath.api.tokenize import DetokenizeRequest, TokenizeRequest
from tokenpath.api.tools import parse_tools
from tokenpath.errors import TokenpathError
from tokenpath.protocol import limits
from tokenpath.protocol.limits import TABLE, Limit
from tokenpath.protocol.names import ADAPTER, check_name, check_path
from tokenpath.protocol.requests import check_priority
from tokenpath.protocol.sampling_params import SamplingParams, StructuredOutput

HI = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def schema(model: type[BaseModel], body: dict) -> None:
    """Validated as the app validates a body: a pydantic error becomes the app's 400."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def tool(i: int, description: str = "", name: str = "") -> dict:
    return {"type": "function", "function": {"name": name or f"t{i}", "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


def nested(depth: int) -> dict:
    node: dict = {"type": "object"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


def middleware_status(headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """The status BodyLimitMiddleware answers a request with (200: it let it through)."""
    sent: list[dict] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    caps = Caps()
    mw = BodyLimitMiddleware(app, limits.BODY_BYTES.value, caps.max_header_bytes)
    asyncio.run(mw({"type": "http", "headers": headers}, receive, send))
    return sent[0]["status"]


class Refused(TokenpathError):
    """A refusal seen only as a status code (headers, body: before any param exists)."""


def by_status(status: int) -> None:
    if status != 200:
        err = Refused("refused")
        err.status_code = status
        raise err


V = {lim.name: lim.value for lim in TABLE}
PROBES: dict[str, Callable[[], object]] = {
    "n": lambda: check_fields(Caps(), chat(n=V["n"] + 1)),
    "max_tokens": lambda: check_fields(Caps(), chat(max_tokens=V["max_tokens"] + 1)),
    "stop": lambda: check_fields(Caps(), chat(stop=["x"] * (V["stop"] + 1))),
    "messages": lambda: check_fields(Caps(), chat(messages=HI * (V["messages"] + 1))),
    "prompts": lambda: check_fields(Caps(), completion(prompt=["hi"] * (V["prompts"] + 1))),
    "embedding_inputs": lambda: embedding_inputs(EmbeddingRequest(model="m", input=["a"] * (V["embedding_inputs"] + 1)),
                                                 Caps().max_embedding_inputs),
    "request_tokens": lambda: check_request_tokens(Caps().max_request_tokens, 1, 1, 1, V["request_tokens"]),
    "header_bytes": lambda: by_status(middleware_status([(b"x-pad", b"a" * V["header_bytes"])], b"")),
    "body_bytes": lambda: by_status(middleware_status([], b"a" * (V["body_bytes"] + 1))),
    "top_logprobs": lambda: chat(logprobs=True, top_logprobs=V["top_logprobs"] + 1).reject_unsupported(),
    "logit_bias": lambda: chat(logit_bias={str(i): 1 for i in range(V["logit_bias"] + 1)}).token_bias(100_000),
    "stop_token_ids": lambda: schema(ChatCompletionRequest, {"model": "m", "messages": HI,
                                                             "stop_token_ids": [1] * (V["stop_token_ids"] + 1)}),
    "seed": lambda: schema(ChatCompletionRequest, {"model": "m", "messages": HI, "seed": V["seed"] + 1}),
    "timeout": lambda: schema(ChatCompletionRequest, {"model": "m", "messages": HI, "timeout": V["timeout"] + 1}),
    "keep_alive": lambda: schema(ChatCompletionRequest, {"model": "m", "messages": HI,
                                                         "keep_alive": "m" * (V["keep_alive"] + 1)}),
    "parsed_messages": lambda: schema(TokenizeRequest, {"model": "m", "messages": HI * (V["parsed_messages"] + 1)}),
    "detokenize_tokens": lambda: schema(DetokenizeRequest, {"model": "m", "tokens": [1] * (V["detokenize_tokens"] + 1)}),
    "tools": lambda: parse_tools([tool(i) for i in range(V["tools"] + 1)], None, None, None),
    "tool_name_chars": lambda: parse_tools([tool(0, name="n" * (V["tool_name_chars"] + 1))], None, None, None),
    "tools_chars": lambda: parse_tools([tool(0, "d" * V["tools_chars"])], None, None, None),
    "spec_bytes": lambda: check_schema({"type": "object", "description": "d" * V["spec_bytes"]}, "response_format"),
    "choices": lambda: requested(chat(guided_choice=[f"c{i}" for i in range(V["choices"] + 1)])),
    "schema_depth": lambda: check_json_shape(nested(V["schema_depth"]), "response_format"),
    "schema_nodes": lambda: check_json_shape({"type": "array", "items": [1] * V["schema_nodes"]}, "response_format"),
    "enum": lambda: check_json_shape({"enum": list(range(V["enum"] + 1))}, "response_format"),
    "enum_total": lambda: check_json_shape({"properties": {f"p{i}": {"enum": list(range(V["enum"]))}
                                                           for i in range(V["enum_total"] // V["enum"] + 1)}},
                                           "response_format"),
    "pattern_chars": lambda: check_regex("a" * (V["pattern_chars"] + 1), "guided_regex"),
    "regex_repeat": lambda: check_regex(f"(a{{{V['regex_repeat']}}}){{2}}", "guided_regex"),
    "metadata": lambda: ResponsesRequest(model="m", input="hi", metadata={str(i): "v" for i in range(V["metadata"] + 1)})
    .reject_unsupported(),
    "response_id": lambda: asyncio.run(_load(None, "r" * (V["response_id"] + 1), "t", "previous_response_id")),  # type: ignore[arg-type]
    "name_chars": lambda: check_name("a" * (V["name_chars"] + 1), ADAPTER, "lora_name"),
    "path_chars": lambda: check_path("/" + "a" * V["path_chars"], "lora_path"),
    "priority": lambda: check_priority(V["priority"] + 1),
    "engine_n": lambda: SamplingParams(n=V["engine_n"] + 1).validate(),
    "engine_stop": lambda: SamplingParams(stop=["x"] * (V["engine_stop"] + 1)).validate(),
    "engine_spec_chars": lambda: StructuredOutput("regex", "a" * (V["engine_spec_chars"] + 1)),
    "top_k": lambda: SamplingParams(top_k=V["top_k"] + 1).validate(),
    "token_id": lambda: SamplingParams(stop_token_ids=[V["token_id"] + 1]).validate(),
    "engine_seed": lambda: SamplingParams(seed=V["engine_seed"] + 1).validate(),
}

# Entries enforced where a fast probe cannot reach: the test that shows each (and what it names).
ELSEWHERE = {
    "conversation_bytes": ("tests/api/test_responses_api.py", "responses_max_bytes"),  # needs the store
    "stream_unsent_bytes": ("tests/reliability/test_slow_readers.py", "client_stalled"),  # a client not reading
    "parallel_calls": ("tests/api/test_tool_formats.py", "parallel_tool_calls"),  # the grammar's, not a refusal
}


def test_every_entry_has_a_probe():
    names = {lim.name for lim in TABLE}
    assert len(names) == len(TABLE), "two entries share a name"
    assert set(PROBES) | set(ELSEWHERE) == names
    assert not set(PROBES) & set(ELSEWHERE)


@pytest.mark.parametrize("lim", [lim for lim in TABLE if lim.name in PROBES], ids=lambda lim: lim.name)
def test_just_over_the_entry_is_refused_naming_its_param(lim: Limit):
    with pytest.raises(TokenpathError) as info:
        PROBES[lim.name]()
    assert info.value.status_code == lim.status, info.value.message
    if lim.param is not None:
        assert info.value.param == lim.param, info.value.message


@pytest.mark.parametrize("name", ["n", "max_tokens", "stop", "messages", "prompts"])
def test_at_the_entry_is_admitted(name: str):
    """The other edge: exactly at the cap passes the same check (so the probes above are just over)."""
    at = {"n": chat(n=V["n"]), "max_tokens": chat(max_tokens=V["max_tokens"]),
          "stop": chat(stop=["x"] * V["stop"]), "messages": chat(messages=HI * V["messages"]),
          "prompts": completion(prompt=["hi"] * V["prompts"])}[name]
    check_fields(Caps(), at)


def test_elsewhere_files_exist_and_name_what_they_check():
    root = Path(__file__).resolve().parents[2]
    for name, (path, marker) in ELSEWHERE.items():
        assert marker in (root / path).read_text(), (name, path, marker)
