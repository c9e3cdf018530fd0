"""One interface for every way a request can reach an engine.

Routers and admission control read `state()`; the API layer consumes `generate()`; a disconnect
becomes `abort()`. Implementations: the in-process engine (`local.py`), a remote
OpenAI-compatible endpoint (`remote.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tokenpath.engine.outputs import RequestOutput
from tokenpath.engine.sampling_params import SamplingParams
from tokenpath.errors import ServiceUnavailableError
from tokenpath.telemetry.timeline import Timeline


class ReplicaBusyError(ServiceUnavailableError):
    """The replica is up but refused the request for load (a remote 429/503 before any token):
    retry elsewhere, but do not eject it."""


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeline: Timeline
    priority: int = 0
    tenant: str = "anonymous"
    session_id: str | None = None
    deadline: float | None = None  # monotonic seconds
    prompt: str | None = None


@dataclass
class ReplicaState:
    """vLLM-compatible meanings, so the same routers can drive vLLM replicas."""

    name: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    healthy: bool = True
    prefix_hashes: set[int] = field(default_factory=set)  # recently cached/routed block hashes
    max_num_seqs: int = 0
    # Extensions read by routing/admission (defaults keep older constructors valid):
    block_size: int = 16  # the engine's KV block size: prefix-aware routing hashes prompts with it
    num_blocks: int = 0  # KV blocks in the pool (0: unknown)
    # Set by the gateway's pool, not the replica: uncached prompt tokens it dispatched there that
    # have not produced a first token yet (what a new request would wait behind).
    pending_prefill_tokens: int = 0
    detail: str | None = None  # why unhealthy, for logs and /health

    @property
    def load(self) -> int:
        """Requests the replica holds right now (queued in the engine or running)."""
        return self.waiting + self.running


class Replica(Protocol):
    name: str

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def state(self) -> ReplicaState: ...
