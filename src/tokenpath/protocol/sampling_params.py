"""Sampling parameters, validated before they reach the engine.

Validation raises `SamplingParamsError` (a 400 at the HTTP layer), never `assert`: a NaN or an
out-of-range value must be a clear client error, not a crash inside a batched step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenpath.errors import SamplingParamsError
from tokenpath.protocol.limits import (
    ENGINE_N,
    ENGINE_SEED,
    ENGINE_SPEC_CHARS,
    ENGINE_STOP,
    TOKEN_ID,
    TOP_K,
    TOP_LOGPROBS,
)

# What the sampler can compute, not only what the API allows. A temperature below SAMPLING_EPS is
# greedy (as in vLLM): dividing logits by 1e-320 gives inf, and inf - inf gives NaN probabilities.
SAMPLING_EPS = 1e-5
# A penalty divides or multiplies logits; below this it overflows float32 to inf.
MIN_REPETITION_PENALTY = 0.01
# The caps (n, stop, top_k, token ids, seeds, logprobs, spec size) are protocol/limits.py's entries:
# what the engine accepts from any caller (the offline LLM, the link), the API's own caps at or below.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match, as text the engine compiles into a grammar.

    `json`: a JSON Schema (serialized); `regex`; `choice`: a JSON list of strings; `grammar`: a
    Lark grammar. Plain strings, so the spec crosses the engine link (msgpack) and a Ray actor
    call as it is, and equal specs are equal cache keys. `tools` marks a tool-call grammar (for
    metrics and tracing only: it is constrained like any other)."""

    kind: str
    spec: str
    tools: bool = False

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {self.kind!r}", param="structured_outputs")
        if not isinstance(self.spec, str) or not self.spec:
            raise SamplingParamsError("structured output spec must be a non-empty string", param="structured_outputs")
        if len(self.spec) > ENGINE_SPEC_CHARS.value:
            raise SamplingParamsError(f"structured output spec is {len(self.spec)} characters, over the limit of "
                                      f"{ENGINE_SPEC_CHARS.value}", param="structured_outputs")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled token's)
    # vLLM's: logprobs of every prompt token after the first (and this many top ones per position);
    # such a prompt is computed whole, never served from the prefix cache (it has no logits there).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100), OpenAI's
    structured: StructuredOutput | None = None  # constrained decoding (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):  # as it arrives over the engine link (asdict + msgpack)
            self.structured = StructuredOutput(**self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        def bad(param: str, msg: str) -> SamplingParamsError:
            return SamplingParamsError(f"{param} {msg}", param=param)

        def finite(param: str, v: float) -> float:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad(param, f"must be a number, got {v!r}")
            if math.isnan(v) or math.isinf(v):
                raise bad(param, f"must be finite, got {v!r}")
            return float(v)

        def integer(param: str, v: object) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(param, f"must be an integer, got {v!r}")
            return v

        if not 1 <= integer("n", self.n) <= ENGINE_N.value:
            raise bad("n", f"must be between 1 and {ENGINE_N.value}, got {self.n}")
        if not 0.0 <= finite("temperature", self.temperature) <= 2.0:
            raise bad("temperature", f"must be between 0 and 2, got {self.temperature}")
        if not 0.0 < finite("top_p", self.top_p) <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= integer("top_k", self.top_k) <= TOP_K.value:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer up to {TOP_K.value}, got {self.top_k}")
        if not 0.0 <= finite("min_p", self.min_p) <= 1.0:
            raise bad("min_p", f"must be between 0 and 1, got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite(name, getattr(self, name)) <= 2.0:
                raise bad(name, f"must be between -2 and 2, got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= finite("repetition_penalty", self.repetition_penalty) <= 2.0:
            raise bad("repetition_penalty",
                      f"must be between {MIN_REPETITION_PENALTY} and 2, got {self.repetition_penalty}")
        if self.seed is not None:
            integer("seed", self.seed)
            if not ENGINE_SEED.least <= self.seed <= ENGINE_SEED.value:
                raise bad("seed", f"must be a 64-bit integer in [{ENGINE_SEED.least}, {ENGINE_SEED.value}], "
                          f"got {self.seed}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop) > ENGINE_STOP.value:
            raise bad("stop", f"allows at most {ENGINE_STOP.value} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "entries must be non-empty strings")
        for t in self.stop_token_ids:
            if not 0 <= integer("stop_token_ids", t) <= TOKEN_ID.value:
                raise bad("stop_token_ids", f"must be token ids in [0, {TOKEN_ID.value}], got {t}")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= TOP_LOGPROBS.value:
            raise bad("logprobs", f"must be between 0 and {TOP_LOGPROBS.value}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= integer("prompt_logprobs", self.prompt_logprobs) \
                <= TOP_LOGPROBS.value:
            raise bad("prompt_logprobs", f"must be between 0 and {TOP_LOGPROBS.value}, got {self.prompt_logprobs}")
        for token, bias in (self.logit_bias or {}).items():  # ids against the vocabulary: at the API edge
            if not 0 <= integer("logit_bias", token) <= TOKEN_ID.value or not -100.0 <= finite("logit_bias", bias) <= 100.0:
                raise bad("logit_bias", f"needs token ids >= 0 and values in [-100, 100], got {token}: {bias}")
