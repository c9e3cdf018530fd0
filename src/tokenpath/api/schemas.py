"""Pydantic request schemas of the OpenAI-compatible API.

Unknown fields are rejected (as OpenAI does) and known fields that would change the output but
are not implemented (tools, structured output, logit_bias, echo, suffix...) are 400s with a clear
message: silently ignoring them would return something the client did not ask for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenpath.errors import InvalidRequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=64)] | None


class _SamplingFields(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI + vLLM extras)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: Stop = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Seconds this request may wait for its first token (LiteLLM's `timeout`); past it, a queued
    # request is removed with a 504. Unset: the default for its priority band.
    timeout: Annotated[float, Field(gt=0, le=86400)] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = None
    skip_special_tokens: bool = True
    # Accepted and ignored: they do not change the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Known but unsupported: anything but the neutral value is a 400 (see `_reject_unsupported`).
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


def _unsupported(name: str, why: str = "is not supported by this server") -> InvalidRequestError:
    return InvalidRequestError(f"{name} {why}", param=name, code="unsupported_parameter")


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def reject_unsupported(self) -> None:
        if self.tools or self.functions:
            raise _unsupported("tools", "(function calling) is not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise _unsupported("tool_choice")
        if self.function_call not in (None, "none", "auto"):
            raise _unsupported("function_call")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", f"type {self.response_format.get('type')!r} (structured "
                               "output) is not supported by this server; only 'text'")
        if self.logit_bias:
            raise _unsupported("logit_bias")
        if self.modalities not in (None, ["text"]) or self.audio:
            raise _unsupported("modalities", "other than ['text'] are not supported by this server")
        if self.prediction:
            raise _unsupported("prediction")
        if self.reasoning_effort is not None:
            raise _unsupported("reasoning_effort")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def reject_unsupported(self) -> None:
        if self.echo:
            raise _unsupported("echo")
        if self.suffix:
            raise _unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "other than n is not supported by this server")
        if self.logit_bias:
            raise _unsupported("logit_bias")

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI's legacy default is 16 tokens.
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Strict):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def reject_unsupported(self, native: int) -> None:
        if self.dimensions is not None and self.dimensions != native:
            raise _unsupported("dimensions", f"must be {native} for this model (no truncation supported)")
