"""One interface for every way a request can reach an engine.

Routers and admission control read `state()`; the gateway consumes `generate()`; a disconnect
becomes `abort()`. Implementations: the in-process engine (`local.py`), tokenpath's own engine
processes over the engine link (`link_client.py`), a remote OpenAI-compatible endpoint such as
vLLM, SGLang or llama.cpp (`remote.py`); the simulated replica for tests is `tests/simulated_replica.py`.

`Replica[ReqT, OutT]` is generic over the request and output it serves. A generation replica is
a `Replica[GenerateRequest, RequestOutput]`: `generate` takes the gateway's `Submission` of a
`GenerateRequest` and yields `RequestOutput` deltas whose `events` are already in this process's
monotonic clock; `tokenpath.replica.events.stamp_events` puts them on the submission's Timeline.
What crosses to the engine (in process, over the link, to a Ray actor) is `submission.request`
alone; the replica keeps the rest, and echoes the submission's prompt text on each output (the
engine never had it).

An embedding model's replica is a `Replica[EmbeddingRequest, EmbeddingOutput]`: `generate`
yields one `EmbeddingOutput` (vectors + event times). So the same `Deployment`, admission, pool,
pickers and Timeline stamping serve both, each typed for its own pair; implementations:
`local_embedding.py` (in-process) and `embedding_link.py` (engine processes over the link).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, TypeVar

from tokenpath.errors import ServiceUnavailableError
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, GenerateRequest, ReplicaState, RequestOutput
from tokenpath.protocol.submission import Submission

# What a replica takes and what it yields: a generation's pair or an embedding's.
ReqT = TypeVar("ReqT", bound=GenerateRequest | EmbeddingRequest)
OutT = TypeVar("OutT", bound=RequestOutput | EmbeddingOutput)
ReqT_contra = TypeVar("ReqT_contra", bound=GenerateRequest | EmbeddingRequest, contravariant=True)
OutT_co = TypeVar("OutT_co", bound=RequestOutput | EmbeddingOutput, covariant=True)


class ReplicaBusyError(ServiceUnavailableError):
    """The replica is up but refused the request for load (a remote 429/503 before any token):
    retry elsewhere, but do not eject it."""


class ReplicaStalledError(ServiceUnavailableError):
    """The replica's engine went silent past the stall bound (`replica.liveness`). Before the first
    token the router retries the request elsewhere; after it, the client gets this 503. The pool
    does not eject on it: the replica's own state already does, and recovers the moment it is heard."""

    RETRY_AFTER_S = 1
    default_code = "replica_stalled"


class ProgressTimeoutError(ServiceUnavailableError):
    """One request made no progress on a live replica within its bound (no first token within
    `first_token_s` of dispatch, or no next token within `next_token_s`)."""

    default_code = "progress_timeout"


def replica_fault(exc: BaseException) -> bool:
    """Whether an exception out of a replica's `generate` is the replica's own fault.

    Only these eject a replica: the engine or its link gone (`EngineDeadError` and every other
    503 a replica raises, a broken connection or pipe, an end of stream). Anything else raised
    for one request (a value the engine or a codec could not take, a bug on one request's path)
    is that request's: it fails alone, and the replica keeps serving. A replica broken for
    every request is still caught, by what only a broken replica shows: its process exits, its
    link drops, or its step loop stops (`replica.liveness`)."""
    return isinstance(exc, ServiceUnavailableError | OSError | EOFError)


class Replica(Protocol[ReqT_contra, OutT_co]):
    name: str

    def generate(self, submission: Submission[ReqT_contra]) -> AsyncGenerator[OutT_co, None]:
        """The request's outputs, as they come. An async generator: closing it (`aclose`) before
        the last output stops the request on its engine."""

    async def abort(self, request_id: str) -> None: ...

    def state(self) -> ReplicaState: ...
