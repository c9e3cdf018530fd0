"""Plain data that crosses the bench's boundaries: what to send, what came back, where to send it.

Kept free of I/O so the metric arithmetic can be tested against hand-written records and so a
`--json` file can be read back (`--merge`) into exactly the objects a live run produced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Api = Literal["chat", "completions"]
# How a target is told to produce exactly `output_len` tokens (servers differ in what they accept):
#   vllm        ignore_eos + min_tokens + max_tokens (vLLM, SGLang, tokenpath)
#   min_tokens  min_tokens + max_tokens (llama-cpp-python: honours min_tokens)
#   hf          max_tokens + generation_config {"eos_token_id": -1} (`transformers serve`)
#   none        max_tokens only: outputs may stop early, and the report says how many did
ExactMode = Literal["vllm", "min_tokens", "hf", "none"]
EXACT_MODES: tuple[str, ...] = ("vllm", "min_tokens", "hf", "none")


@dataclass(frozen=True)
class Target:
    """One OpenAI-compatible endpoint under test."""

    name: str
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api: Api = "chat"
    api_key: str | None = None
    exact: ExactMode = "vllm"
    note: str = ""  # what the peer is: engine, dtype/quantization, batching

    def public(self) -> dict[str, Any]:
        """The target as written to JSON: never the key itself."""
        d = asdict(self)
        d["api_key"] = "set" if self.api_key else None
        return d


@dataclass
class RequestSpec:
    """One request of the workload, before it is sent. Identical across targets for a given seed."""

    index: int
    input_len: int  # intended prompt tokens (by the bench's tokenizer, or approximate)
    output_len: int  # intended output tokens
    user_text: str
    system_text: str | None = None  # shared-prefix workload: the group's long system prompt
    group: int | None = None  # shared-prefix group
    session: int | None = None  # multi-turn session id
    turn: int = 0  # multi-turn: 0 for the first message of a session


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are seconds on the client's monotonic clock,
    relative to the request's own send time except `start`, which is relative to the run start."""

    index: int
    start: float = 0.0
    success: bool = False
    status: int | None = None  # HTTP status; None when the connection itself failed
    error: str | None = None
    ttft: float | None = None  # to the first chunk carrying content
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2el: float | None = None  # to the last content chunk (as vllm bench serve)
    output_tokens: int = 0
    output_tokens_source: Literal["usage", "chunks"] = "chunks"
    prompt_tokens: int | None = None  # as the server reported in usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits
    intended_input_len: int = 0
    intended_output_len: int = 0
    server_timing: dict[str, float] | None = None  # seconds, per server stage (telemetry.stages) and total
    group: int | None = None
    session: int | None = None
    turn: int = 0
    text: str = ""  # kept for multi-turn history; dropped from JSON

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1), defined only for more than one output token."""
        if not self.success or self.ttft is None or self.e2el is None or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        d["tpot"] = self.tpot
        # Microseconds are far below what a loopback client can resolve; rounding keeps files small.
        for k in ("start", "ttft", "e2el", "tpot"):
            if d[k] is not None:
                d[k] = round(d[k], 6)
        d["itl"] = [round(g, 6) for g in self.itl]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "text"}
        return cls(**known)


@dataclass(frozen=True)
class LoadPoint:
    """One arrival process. rate=None and concurrency=N: closed loop with N clients.
    rate=R: Poisson arrivals at R req/s (inf: all at once, a burst), capped by concurrency if set."""

    rate: float | None = None
    concurrency: int | None = None

    def label(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append("burst" if self.rate == float("inf") else f"rate={self.rate:g}")
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        return ",".join(parts) or "c=1"

    def to_json(self) -> dict[str, Any]:
        return {"rate": None if self.rate is None else (str(self.rate) if self.rate == float("inf") else self.rate),
                "concurrency": self.concurrency, "label": self.label()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoadPoint:
        rate = d.get("rate")
        return cls(rate=None if rate is None else float(rate), concurrency=d.get("concurrency"))
