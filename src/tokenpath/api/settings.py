"""What the HTTP layer itself needs to know: body and header limits, and the caps on request
fields. `tokenpath.server.config.ServerConfig` extends it with where to listen and what to serve."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenpath.config import Flag, env_grammar_warmup, parse_bytes
from tokenpath.protocol import limits


def _cap(limit: limits.Limit) -> Any:
    """The field of a setting that changes `limit`: its default and accepted range from the table."""
    return Field(limit.value, ge=limit.setting_least, le=limit.setting_most, description=limit.bounds)


class Caps(BaseModel):
    """Upper bounds on request fields; beyond them a request is a 400, not a resource problem.
    Defaults and ranges are `tokenpath.protocol.limits`' entries (their `setting` is `caps.<field>`)."""

    model_config = ConfigDict(extra="forbid")

    max_n: int = _cap(limits.N)
    max_tokens: int = _cap(limits.MAX_TOKENS)
    max_stop: int = _cap(limits.STOP)
    max_messages: int = _cap(limits.MESSAGES)
    max_prompts: int = _cap(limits.PROMPTS)  # prompts in one /v1/completions request
    max_embedding_inputs: int = _cap(limits.EMBEDDING_INPUTS)  # inputs in one /v1/embeddings request
    max_header_bytes: int = _cap(limits.HEADER_BYTES)
    # Tokens one request may cost at most: its prompt tokens plus n x max_tokens for every prompt.
    max_request_tokens: int = _cap(limits.REQUEST_TOKENS)


class ApiSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_size: str | int = Field(limits.size_text(limits.BODY_BYTES.value),
                                     description="largest accepted request body, e.g. 4MiB")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests get on shutdown")
    caps: Caps = Field(default_factory=Caps)
    # /metrics is open, as vLLM's is (scrape configs and aiperf send no key), with tenant series
    # summed away unless the caller has an admin key. `metrics_require_key`: an admin key for all of
    # it. `metrics_public`: open with the tenant series too (the operator publishes tenant names).
    metrics_require_key: bool = Field(
        False, description="/metrics needs an admin key when auth is on; off: open, as vLLM's, with tenant series "
        "only for admin keys")
    metrics_public: bool = Field(
        False, description="/metrics shows the tenant series to every caller, not only to admin keys")
    # Slow clients (slowloris): a connection must finish its request headers, and then its body,
    # within these many seconds, or it is closed (headers) or answered 408 (body).
    header_timeout: float = Field(10.0, gt=0)
    body_timeout: float = Field(10.0, gt=0)
    # How long an idle keep-alive connection stays open (uvicorn's --timeout-keep-alive). Longer
    # than the clients' own expiry (httpx, hence the OpenAI SDK and LiteLLM: 5 s), so the client
    # always closes first: at uvicorn's default of 5 s both sides time out together, and a request
    # sent on a connection the server is closing fails with a connection error, never seen here.
    timeout_keep_alive: float = Field(65.0, gt=0)
    # Browser-facing safety (`tokenpath.api.browser`): Host names beyond localhost/127.0.0.1/[::1],
    # origins whose pages may call the API (CORS, default none; "*" for any), docs without a key.
    allowed_hosts: Annotated[list[str], Flag(metavar="HOST[,HOST]", gather="csv")] = Field(
        default_factory=list, description="Host header names accepted beside localhost, 127.0.0.1 and [::1] "
        "(checked when bound to loopback, against DNS rebinding; and on any address once given)")
    allowed_origins: Annotated[list[str], Flag(metavar="ORIGIN[,ORIGIN]", gather="csv")] = Field(
        default_factory=list, description="origins whose web pages may call the API (CORS; none unless given; "
        "'*' for any), e.g. https://app.example.com")
    public_docs: bool = Field(
        False, description="serve /docs, /redoc and /openapi.json without a key even when auth is on")
    # Causes for every request and per-window engine figures for /diagnose (`telemetry.causes`,
    # `telemetry.engine_window`); off only to measure what they cost (`serve --no-causes`).
    causes: bool = Field(
        True, description="derive causes (trace, audit row, log, spans) and sample engine figures for /diagnose's "
        "windows; --no-causes is what benchmarks/causes_overhead.py compares against")
    # Structured output's one-time costs paid at start-up, not by the first structured request
    # (api/structured.py: the vocabulary read into llguidance, ~1 s holding the GIL, and a grammar
    # worker started, ~2 s of CPU and ~100 MiB in a process of its own), which otherwise froze every
    # stream of the process for a second. Off: paid on first use, as before (the test suite's
    # servers, most of which never ask for a grammar: TOKENPATH_GRAMMAR_WARMUP=0).
    grammar_warmup: bool = Field(
        default_factory=env_grammar_warmup, description="read the vocabulary into the grammar engine and start "
        "a grammar worker at start-up, so the first structured request does not stall other streams "
        "(default: on; $TOKENPATH_GRAMMAR_WARMUP=0 turns it off)")
    # Streaming clients that stop reading (`api.sse.SSEResponse`): a stream whose client has taken
    # nothing for `stream_stall_timeout` seconds (one send to it waited that long on a full socket),
    # or whose output waiting in the gateway for it passes `stream_max_unsent`, is ended at once:
    # its engine slot, KV blocks and admission slot are freed, its connection is dropped, and its
    # audit row says `client_stalled` (status 499). Without it a client that never reads holds
    # all three for as long as it keeps the connection open.
    stream_stall_timeout: float = Field(
        30.0, gt=0, description="seconds a streaming client may go without reading before its stream is "
        "aborted and its slot freed")
    stream_max_unsent: str | int = Field(
        limits.size_text(limits.STREAM_UNSENT_BYTES.value),
        description="output waiting in the gateway for one streaming client beyond which it is "
        "aborted as stalled, e.g. 1MiB")

    @field_validator("stream_max_unsent")
    @classmethod
    def _check_unsent(cls, v: str | int) -> str | int:
        if parse_bytes(v) < (limits.STREAM_UNSENT_BYTES.setting_least or 0):
            raise ValueError("stream_max_unsent must be at least "
                             f"{limits.size_text(limits.STREAM_UNSENT_BYTES.setting_least or 0)}")
        return v

    @property
    def stream_max_unsent_bytes(self) -> int:
        return parse_bytes(self.stream_max_unsent)
    # vLLM's --reasoning-parser (api/reasoning.py): split a reasoning model's <think> block off its
    # chat replies. auto: where the chat template mentions <think>; none: never; qwen3 and
    # deepseek_r1 (one parser: both write the same tags): always.
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        "auto", description="split a reasoning model's <think> block off chat replies into reasoning_content "
        "(vLLM's flag); auto: where the chat template mentions <think>")
    # llama.cpp's --reasoning-budget (api/thinking.py): a reasoning model's think block is closed
    # for it after this many tokens, unless the request sets its own (Anthropic's budget_tokens).
    reasoning_budget: int | None = Field(None, ge=1, description="close a reasoning model's think block after N "
                                         "tokens (llama.cpp's flag), unless the request sets its own budget "
                                         "(Anthropic's thinking.budget_tokens)")
    # Anthropic's thinking-block signatures (`api/anthropic/signature.py`): an HMAC under this key;
    # gateways behind one address share it. Unset: a key kept in the data dir.
    thinking_signing_key: str | None = Field(
        None, description="key that signs /v1/messages thinking blocks, checked when they come back (default: "
        "$TOKENPATH_THINKING_SIGNING_KEY, else a random key kept in the data dir); the same on every gateway "
        "behind one address")
    # The Responses API (`api/responses`): `store` is honoured (default true, as OpenAI has it) unless
    # the operator turns it off; a stored response is kept this many seconds, and a conversation
    # (a `previous_response_id` chain with its new input) over this many bytes is refused.
    responses_store: bool = True
    responses_retention_s: float = Field(30 * 86400.0, gt=0)
    responses_max_bytes: int = _cap(limits.CONVERSATION_BYTES)

    @property
    def max_body_bytes(self) -> int:
        return parse_bytes(self.max_body_size)
