"""`EmbeddingRequest` and `EmbeddingOutput`: an embedding request's trip to a replica and back.

The twin of `GenerateRequest` / `RequestOutput` for pooling models. Built once by the API layer
(tokenized and validated there), passed through admission, routing and the replica to the
embedding engine; across the engine link its fields travel as they are (`protocol.wire`). Like
a `GenerateRequest` it holds only what the engine needs: the gateway carries it in a
`protocol.submission.Submission`, with its Timeline and session id. It answers in one `EmbeddingOutput` (vectors + the engine's event
times), which the replica boundary stamps on the request's Timeline like a generation's last
delta: `scheduled` when its encoder batch started, `first_token` when the vectors were ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenpath.protocol.outputs import EngineEvents
from tokenpath.protocol.requests import check_priority


@dataclass
class EmbeddingRequest:
    request_id: str
    inputs: list[list[int]]  # one token-id sequence per input, already validated
    priority: int = 0
    tenant: str = "anonymous"
    deadline: float | None = None  # monotonic, sender's clock (crosses the link as seconds left)
    traceparent: str | None = None
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        check_priority(self.priority)

    @property
    def prompt_token_ids(self) -> list[int]:
        """Every input's ids, in order: what admission counts as this request's prefill work and
        what a prefix-aware picker hashes (identical requests then land on the same replica)."""
        return [t for ids in self.inputs for t in ids]

    @property
    def lora(self) -> None:
        """No adapter: an embedding runs on the base model (so the pickers' adapter affinity
        never applies to it)."""
        return None

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


@dataclass
class EmbeddingOutput:
    """All the request's vectors at once (an embedding has no deltas), so `finished` is True."""

    request_id: str
    vectors: list[list[float]]
    num_prompt_tokens: int
    events: EngineEvents = field(default_factory=EngineEvents)
    finished: bool = True
