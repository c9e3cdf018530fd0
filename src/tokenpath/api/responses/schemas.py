"""The Responses API request body, as OpenAI specifies it (`responses.create`).

Unknown fields are 400s naming them (as for chat completions); fields that would change the
output and cannot be honoured here are refused by name in `ResponsesRequest.reject_unsupported`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tokenpath.api.schemas import _Body
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import METADATA


def unsupported(name: str, why: str = "is not supported by this server") -> InvalidRequestError:
    return InvalidRequestError(f"{name} {why}; remove it from the request", param=name,
                               code="unsupported_parameter")


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    # Accepted, no effect on the output here.
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused by name when set (see reject_unsupported).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    def reject_unsupported(self) -> None:
        if self.background:
            raise unsupported("background", "(background responses) is not supported by this server")
        if self.conversation is not None:
            raise unsupported("conversation", "(the Conversations API) is not supported; chain turns with "
                              "previous_response_id")
        if self.prompt is not None:
            raise unsupported("prompt", "(stored prompt templates) is not supported by this server")
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        if self.reasoning and set(self.reasoning) - {"effort", "summary", "generate_summary"}:
            extra = sorted(set(self.reasoning) - {"effort", "summary", "generate_summary"})[0]
            raise InvalidRequestError(f"unrecognized request argument supplied: reasoning.{extra}",
                                      param=f"reasoning.{extra}")
        if self.truncation not in (None, "auto", "disabled"):
            raise InvalidRequestError(f"truncation must be 'auto' or 'disabled', got {self.truncation!r}",
                                      param="truncation")
        if self.metadata is not None and len(self.metadata) > METADATA.value:
            raise InvalidRequestError(f"metadata has {len(self.metadata)} pairs, over the limit of {METADATA.value}",
                                      param="metadata")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequestError("input must not be empty", param="input")
