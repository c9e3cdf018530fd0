"""`Submission`: a request as the gateway holds it, with what only the gateway needs around it.

The engine's request types (`GenerateRequest`, `EmbeddingRequest`) hold what an engine acts on
and nothing else, so what crosses to an engine (in process, over the link, to a Ray actor) is the
bare request and nothing needs stripping on the way. The gateway keeps the rest here, from the
API layer down to the replica boundary, which hands the engine `submission.request`:

- `timeline`, the gateway's per-request record: admission and routing stamp it, and the replica
  boundary puts the engine's events on it (`tokenpath.replica.events`);
- `prompt`, the text when there was one: the replica boundary echoes it on each `RequestOutput`
  (an engine never sees text, only token ids);
- `session_id`: read by the session-affinity picker, and sent as OpenAI's `user` field to a
  remote server (`replica.remote`).

It is what a replica picker reads (`Routable`): prompt ids and adapter come from the request,
the session id from here. One plain class with `__slots__` (made once per request).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from tokenpath.protocol.embeddings import EmbeddingRequest
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.telemetry.timeline import Timeline

# Covariant: a `Submission[GenerateRequest]` is a submission of some request, which is what
# admission and the pickers take (nobody swaps a submission's request for another).
R = TypeVar("R", bound=GenerateRequest | EmbeddingRequest, covariant=True)


class Submission(Generic[R]):
    """One request on its way through the gateway: `request` goes to the engine, the rest stays.

    `timeline` defaults to a fresh record started now (a caller without an HTTP request, such as a
    benchmark or a test: its record starts where it submits)."""

    __slots__ = ("prompt", "request", "session_id", "timeline")

    def __init__(self, request: R, timeline: Timeline | None = None, *, prompt: str | None = None,
                 session_id: str | None = None) -> None:
        self.request: R = request
        self.timeline = Timeline(request.request_id) if timeline is None else timeline
        self.prompt = prompt
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"Submission({self.request!r}, session_id={self.session_id!r})"

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def lora(self) -> LoraRef | None:
        return self.request.lora
