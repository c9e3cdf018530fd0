"""Request bodies of Anthropic's Messages API, strict like the OpenAI ones (an unknown field is a
400 naming it). Content blocks stay dicts here: `translate` checks each one and names the block
(`messages.2.content.1`) in its 400, which a pydantic union of block models would not say clearly."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tokenpath.api.schemas import _Body, _Strict
from tokenpath.protocol.limits import PARSED_MESSAGES


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Body):
    """What `/v1/messages/count_tokens` takes: the prompt half of a Messages request."""

    model: str
    messages: Annotated[list[MessageParam], Field(max_length=PARSED_MESSAGES.value)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. `max_tokens` is required, as Anthropic requires it."""

    max_tokens: Annotated[int, Field(ge=1)]
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # Accepted without effect: one tier here, and the prefix cache is automatic.
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
