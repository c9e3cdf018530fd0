"""One interface for every way a request can reach an engine.

Routers and admission control read `state()`; the gateway consumes `generate()`; a disconnect
becomes `abort()`. Implementations: the in-process engine (`local.py`), tokenpath's own engine
processes over the engine link (`link_client.py`), a remote OpenAI-compatible endpoint such as
vLLM, SGLang or llama.cpp (`remote.py`); the simulated replica for tests is `tests/simulated_replica.py`.

Every implementation yields `RequestOutput` deltas whose `events` are already in this process's
monotonic clock; `tokenpath.replica.events.stamp_events` puts them on the request's Timeline.

An embedding model's replicas implement the same interface with the pooling pair of types:
`generate(EmbeddingRequest)` yields one `EmbeddingOutput` (vectors + event times). So the same
`Deployment`, admission, pool, pickers and Timeline stamping serve both; implementations:
`local_embedding.py` (in-process) and `embedding_link.py` (engine processes over the link).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from tokenpath.errors import ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, ReplicaState, RequestOutput


class ReplicaBusyError(ServiceUnavailableError):
    """The replica is up but refused the request for load (a remote 429/503 before any token):
    retry elsewhere, but do not eject it."""


class ReplicaStalledError(ServiceUnavailableError):
    """The replica's engine went silent past the stall bound (`replica.liveness`). Before the first
    token the router retries the request elsewhere; after it, the client gets this 503. The pool
    does not eject on it: the replica's own state already does, and recovers the moment it is heard."""

    RETRY_AFTER_S = 1

    def __init__(self, message: str, **kw) -> None:
        kw.setdefault("code", "replica_stalled")
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(self.RETRY_AFTER_S))


class ProgressTimeoutError(ServiceUnavailableError):
    """One request made no progress on a live replica within its bound (no first token within
    `first_token_s` of dispatch, or no next token within `next_token_s`)."""

    def __init__(self, message: str, **kw) -> None:
        kw.setdefault("code", "progress_timeout")
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", "1")


class Replica(Protocol):
    name: str

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def state(self) -> ReplicaState: ...
