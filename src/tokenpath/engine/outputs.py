"""What the engine hands back: per-request outputs with per-choice deltas, and its state."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, token text, logprob)


@dataclass
class CompletionOutput:
    """One choice. From `AsyncEngine.generate` the fields are *deltas* since the previous yield;
    from `LLM.generate` they are the whole completion."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) and counts recorded by the engine for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    # Set when the engine failed this request (a step raised): the request ends here, on this
    # replica, and must not be retried elsewhere, since it may be what broke the step.
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineState:
    """What routers, admission control and /metrics read (vLLM-compatible meanings)."""

    waiting: int
    running: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_blocks: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were served from it
    num_preemptions: int
    prompt_tokens: int  # total prompt tokens computed or cached
    generation_tokens: int
    healthy: bool = True
    steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
