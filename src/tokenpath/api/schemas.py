"""Pydantic request schemas of the OpenAI-compatible API.

Unknown fields are rejected (as OpenAI does) and known fields that would change the output but
are not implemented (legacy `functions`, suffix...) are 400s with a clear message:
silently ignoring them would return something the client did not ask for. Every error names the
parameter (`param`) and says what to send instead.

Every string of a body, keys included, is checked once for lone UTF-16 surrogates (JSON allows
`"\ud800"`, Unicode text does not; tokenizers fail on them), so one check covers every field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import (
    KEEP_ALIVE_CHARS,
    LOGIT_BIAS,
    SEED,
    STOP_TOKEN_IDS,
    TIMEOUT_S,
    TOP_LOGPROBS,
)


def param_error(param: str, message: str) -> PydanticCustomError:
    """A validation error that reaches the client as a 400 naming `param` (see api.errors)."""
    return PydanticCustomError("tokenpath_param", message, {"param": param})


def _find_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """(path, character) of the first string, or key, that is not encodable Unicode."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return where, v[exc.start]
        elif isinstance(v, dict):
            for k, item in v.items():
                key = str(k).encode("utf-8", "backslashreplace").decode()  # the path itself must be sendable
                sub = f"{where}.{key}" if where else key
                stack.append((k, sub))
                stack.append((item, sub))
        elif isinstance(v, list):
            stack.extend((item, f"{where}.{i}" if where else str(i)) for i, item in enumerate(v))
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Body(_Strict):
    """A whole request body: its strings are checked once, before field validation."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = _find_surrogate(data, "")
        if found is not None:
            where, char = found
            raise param_error(where, f"{where} contains a lone UTF-16 surrogate ({ascii(char)}), which is not "
                              "valid Unicode; send the text as valid UTF-8")
        return data


class ContentPart(BaseModel):
    """One part of a message's content. Only text is supported; other types are named in the 400."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


_PART_KINDS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file",
               "audio_url": "audio", "video_url": "video"}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    # What OpenAI's own replies carry, so the SDK's `message.model_dump()` is valid history: ignored
    # (no audio or annotations are ever produced here), except the reasoning of a past turn, which
    # templates that know it (Qwen3) render (`api.inputs.chat_messages`).
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def check(self, i: int) -> None:
        """OpenAI's rules for one message: text-only content, null content only for an assistant
        message that carries tool calls, `tool_calls` only on assistant messages, and a `tool`
        message answering a call by its id. (The calls themselves: `api.tools.check_history_calls`.)"""
        where = f"messages.{i}"
        if self.function_call:
            raise InvalidRequestError(f"{where}.function_call (the legacy functions API) is not supported; send "
                                      "tool_calls", param=f"{where}.function_call", code="unsupported_parameter")
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls is only allowed on assistant messages",
                                      param=f"{where}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError(f"{where}.tool_call_id is required on a tool message: the id of the call it "
                                      "answers", param=f"{where}.tool_call_id")
        if self.content is None and self.tool_calls:
            return
        if self.content is None:
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of text parts; null is only allowed for an "
                "assistant message with tool_calls", param=f"{where}.content")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            at = f"{where}.content.{j}"
            if part.type == "text":
                if not isinstance(part.text, str):
                    raise InvalidRequestError(f"{at}.text must be a string", param=f"{at}.text")
                continue
            kind = _PART_KINDS.get(part.type)
            if kind is not None:
                raise InvalidRequestError(f"{at}: {kind} inputs are not supported by this model; send text parts "
                                          "only", param=at, code="unsupported_content")
            raise InvalidRequestError(f"{at}.type {part.type!r} is not a known content part type; use 'text'",
                                      param=f"{at}.type")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extra (guidellm always sends it): with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False
    # OpenAI's: random padding against length side channels. Accepted, a no-op (api/openai_fields.py).
    include_obfuscation: bool | None = None


# No length bound here: a bound inside the union would make 1,000 strings fail as "Input should be a
# valid string"; `inputs.check_caps` refuses more than `caps.max_stop` with a message naming the cap.
Stop = str | list[str] | None


class _SamplingFields(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI + vLLM extras)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: Stop = None
    # OpenAI's and vLLM's bound: a signed 64-bit integer (the engine link carries nothing wider).
    seed: Annotated[int, Field(ge=SEED.least, le=SEED.value)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Seconds this request may wait for its first token (LiteLLM's `timeout`); past it, a queued
    # request is removed with a 504. Unset: the default for its priority band.
    timeout: Annotated[float, Field(gt=0, le=TIMEOUT_S.value)] | None = None
    # Ollama's `keep_alive`: how long a model loaded on demand stays loaded once idle ("5m", seconds;
    # negative: for ever, 0: unload when done). routing.catalog; ignored for a model not in a catalog.
    keep_alive: Annotated[str, Field(max_length=KEEP_ALIVE_CHARS.value)] | float | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Annotated[list[int], Field(max_length=STOP_TOKEN_IDS.value)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted and ignored: they do not change the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Token id (as a string, as OpenAI sends it) -> bias added to its logit, -100..100.
    logit_bias: dict[str, float] | None = None
    # Structured output (api/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields. At most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "stream_options is only allowed when stream is true; set "
                              "\"stream\": true or remove stream_options")
        return self

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer ids, checked against the model's vocabulary; None when empty."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > LOGIT_BIAS.value:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} entries, over the limit of "
                                      f"{LOGIT_BIAS.value}; bias fewer tokens", param="logit_bias")
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                                          param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(f"logit_bias token id {token} is outside this model's vocabulary "
                                          f"[0, {vocab_size}); use ids its tokenizer produces", param="logit_bias")
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias value for token {token} must be between -100 and 100, "
                                          f"got {bias}", param="logit_bias")
            out[token] = float(bias)
        return out


def _unsupported(name: str, why: str = "is not supported by this server") -> InvalidRequestError:
    return InvalidRequestError(f"{name} {why}; remove it from the request", param=name,
                               code="unsupported_parameter")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Newer OpenAI fields and vLLM's chat_template_kwargs: each field's fate is in api/openai_fields.py.
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def reject_unsupported(self) -> None:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages")
        for i, m in enumerate(self.messages):
            m.check(i)
        if self.functions:
            raise _unsupported("functions", "(the legacy functions API) is not supported by this server; send tools")
        if self.function_call not in (None, "none", "auto"):
            raise _unsupported("function_call", "(the legacy functions API) is not supported; send tool_choice")
        if self.modalities not in (None, ["text"]):
            raise _unsupported("modalities", "other than ['text'] (audio output) are not supported by this server")
        if self.audio:
            raise _unsupported("audio", "(audio output) is not supported by this server")
        if self.prediction:
            raise _unsupported("prediction")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true; set \"logprobs\": true",
                                      param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= TOP_LOGPROBS.value:
            raise InvalidRequestError(f"top_logprobs must be between 0 and {TOP_LOGPROBS.value}, got "
                                      f"{self.top_logprobs}", param="top_logprobs")

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
    # vLLM's extra: each prompt token's logprob (and this many top ones), for perplexity.
    prompt_logprobs: StrictInt | None = None  # strict: true or 1.5 is a 400, not 1
    # vLLM's extra: each choice (and each streamed chunk) carries its generated token ids, so a
    # gateway in front (a tokenpath URL replica) counts tokens exactly instead of re-encoding text.
    return_token_ids: StrictBool = False

    def reject_unsupported(self) -> None:
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= TOP_LOGPROBS.value:
                raise InvalidRequestError(f"prompt_logprobs must be an integer between 0 and {TOP_LOGPROBS.value}, "
                                          f"got {self.prompt_logprobs}", param="prompt_logprobs")
            if self.stream:
                raise _unsupported("prompt_logprobs", "is not supported with stream; send \"stream\": false")
        if self.suffix:
            raise _unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "other than n is not supported by this server")

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI's legacy default is 16 tokens.
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Body):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    keep_alive: Annotated[str, Field(max_length=KEEP_ALIVE_CHARS.value)] | float | None = None  # Ollama's (see _SamplingFields)

    def reject_unsupported(self, native: int) -> None:
        if self.dimensions is not None and self.dimensions != native:
            raise _unsupported("dimensions", f"must be {native} for this model (no truncation supported)")
