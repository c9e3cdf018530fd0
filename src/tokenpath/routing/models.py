"""Model routing: which deployment serves this model name, and the path inside a deployment.

A deployment is one served model name with a task (chat, completion, embedding) and one or more
replicas. Aliases map extra names onto a deployment (`gpt-4o-mini -> smollm2-135m-instruct`);
fallbacks name other deployments to try, in order, when one is down (503) or saturated (429).
The task check in `resolve` is what keeps an embedding request away from a chat engine.

`Deployment.generate` is the middle of the path (`Deployment.embed` takes it too, for an
`EmbeddingRequest` on an embedding model's replicas): admission (admit / queue / reject with
Retry-After) -> fair queue -> replica pick (policy + reason on the Timeline) -> replica stream.
A request that fails before its first token is retried once on another replica (the failed one
is ejected); after the first token a failure ends the stream with a 503, because tokens already
sent cannot be taken back. A stalled replica (`replica.liveness`) releases its requests the same
way, with the same request id; the Timeline keeps the first `dispatched` and records the retry
(`retried_after`, `retry_reason`, the replica that finished it). Closing the iterator aborts the
request wherever it is: it leaves the queue, or the replica is told to abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenpath.admission.controller import Admission, AdmissionConfig, FlowController
from tokenpath.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    RequestFailedError,
    ServiceUnavailableError,
    TokenpathError,
)
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, GenerateRequest, ReplicaState
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.outputs import RequestOutput
from tokenpath.replica.base import ProgressTimeoutError, Replica, ReplicaBusyError, ReplicaStalledError
from tokenpath.replica.events import stamp_events
from tokenpath.replica.pool import PoolConfig, ReplicaPool
from tokenpath.routing.replicas import DEFAULT_POLICY, PickerOptions, ReplicaPicker, make_picker
from tokenpath.telemetry import series as metrics
from tokenpath.telemetry.timeline import Timeline

Task = Literal["chat", "completion", "embedding"]
# A chat deployment also serves /v1/completions (same engine, no chat template).
_SERVES: dict[str, set[str]] = {"chat": {"chat", "completion"}, "completion": {"completion"},
                                "embedding": {"embedding"}}
MAX_ATTEMPTS = 2  # the first try plus one retry on another replica, before the first token only


@dataclass
class Deployment:
    name: str
    task: Task
    replicas: list[Replica] = field(default_factory=list)
    tokenizer: Any = None  # tokenpath.engine.tokenizer.Tokenizer (chat/completion) or the embedder's
    max_model_len: int = 2048
    dimensions: int = 0  # an embedding model's vector size (what `dimensions` in a request must equal)
    owned_by: str = "tokenpath"
    policy: str = DEFAULT_POLICY
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pool_config: PoolConfig = field(default_factory=PoolConfig)
    picker_options: PickerOptions = field(default_factory=PickerOptions)
    fallbacks: list[Deployment] = field(default_factory=list)  # filled in by ModelRouter
    processes: list[Any] = field(default_factory=list)  # local engine processes it owns (EngineProcess)
    # What a LoRA adapter is checked against before it is registered: the base model's
    # ModelConfig (None: unknown, e.g. a URL replica; the engine then checks shapes on first use)
    # and the engines' --max-lora-rank.
    model_config: Any = None
    max_lora_rank: int = 64
    _flow: FlowController | None = field(default=None, init=False, repr=False)

    def serves(self, task: str) -> bool:
        return task in _SERVES[self.task]

    @property
    def flow(self) -> FlowController:
        """Built on first use, so replicas may be added after construction (and rebuilt if so)."""
        if self._flow is None or len(self._flow.pool) != len(self.replicas):
            picker: ReplicaPicker = make_picker(self.policy, **self.picker_options)
            pool = ReplicaPool(list(self.replicas), self.pool_config)
            self._flow = FlowController(self.name, pool, picker, self.admission)
        return self._flow

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's own report (not the pool's ejection view): what `/health` shows."""
        return [h.raw_state() for h in self.flow.pool.handles.values()]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request. Closing the iterator aborts the request wherever it is."""
        if request.timeline is None:  # (a caller without an HTTP request: its record starts here)
            request.timeline = Timeline(request.request_id)
        request.timeline.stamp("routed", deployment=self.name, policy=self.policy)
        deployment, admission = await self._admit(request)
        async for out in deployment._run(request, admission):
            yield out

    async def embed(self, request: EmbeddingRequest) -> EmbeddingOutput:
        """An embedding request down the same path as a generation (admission, queue, picker,
        retry, Timeline): one output. Cancelling it aborts the request wherever it is."""
        async with contextlib.aclosing(self.generate(request)) as outputs:  # type: ignore[arg-type]
            async for out in outputs:
                if out.finished:
                    return out  # type: ignore[return-value]
        raise ServiceUnavailableError(f"model '{self.name}' returned no vectors", code="replica_failed")

    def precheck(self, priority: int, tenant: str, received: float, deadline: float | None = None) -> None:
        """Raise the 429/503 admission would answer right now, on this deployment and on each
        fallback, before the caller tokenizes or charges rate limits: refusing is then pure
        bookkeeping. A request that passes is checked again by `generate`, with its prompt."""
        first_error: TokenpathError | None = None
        for dep in (self, *self.fallbacks):
            try:
                dep.flow.check(priority, tenant, dep.flow.queue_deadline(priority, received, deadline), record=False,
                               first_token_by=deadline)
                return
            except (ServiceUnavailableError, RateLimitError) as exc:
                first_error = first_error or exc
        assert first_error is not None
        metrics.REJECTIONS.labels(self.name, first_error.code or "rejected").inc()
        raise first_error

    async def _admit(self, request: GenerateRequest) -> tuple[Deployment, Admission]:
        """Admission on this deployment, then on each fallback in order, on 503/429 only."""
        first_error: TokenpathError | None = None
        for dep in (self, *self.fallbacks):
            try:
                admission = await dep.flow.acquire(request)
            except (ServiceUnavailableError, RateLimitError) as exc:
                first_error = first_error or exc
                continue
            if dep is not self:
                request.timeline.attrs.update(deployment=dep.name, fallback_from=self.name,
                                              fallback_reason=first_error.code if first_error else None)
            return dep, admission
        assert first_error is not None
        raise first_error

    async def _run(self, request: GenerateRequest, admission: Admission) -> AsyncIterator[RequestOutput]:
        tried: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            replica = admission.handle.replica
            tried.add(replica.name)
            stream = replica.generate(request)
            started = finished = False
            failure: str | None = None
            retry_reason = "busy"
            try:
                async for out in self._started_by(stream, request, replica.name):
                    stamp_events(request.timeline, out)  # the one place engine events reach the Timeline
                    if not started:
                        self.flow.started(admission)
                    started = True
                    finished = finished or out.finished
                    yield out
                if not finished:
                    raise ServiceUnavailableError(f"replica '{replica.name}' ended the stream early")
                return
            except Exception as exc:
                if isinstance(exc, TokenpathError) and exc.status_code < 500:
                    raise  # the request's own fault: no retry, no ejection
                if isinstance(exc, DeadlineExceededError):
                    raise  # out of time, not a replica fault: no retry, no ejection
                if isinstance(exc, RequestFailedError):
                    raise  # it broke an engine step: retrying it would break the next replica too
                # A busy replica is retried elsewhere but not ejected; a stalled one has ejected itself
                # (and recovers the moment it is heard, with no backoff); anything else ejects it.
                released = isinstance(exc, (ReplicaStalledError, ProgressTimeoutError))
                failure = None if released or isinstance(exc, ReplicaBusyError) else f"{type(exc).__name__}: {exc}"
                retry_reason = (exc.code if released else None) or failure or "busy"
                if started or attempt == MAX_ATTEMPTS:
                    if isinstance(exc, ServiceUnavailableError):
                        raise
                    raise ServiceUnavailableError(
                        f"replica '{replica.name}' of model '{self.name}' failed: {exc}",
                        code="replica_failed") from exc
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
                if not finished:
                    with contextlib.suppress(Exception):
                        await replica.abort(request.request_id)
                self.flow.release(admission, ok=finished, failure=failure)
            # Failed before the first token: once more, elsewhere.
            metrics.RETRIES.labels(self.name).inc()
            request.timeline.attrs.update(retried_after=replica.name, retry_reason=retry_reason,
                                          retry_lost_s=round(time.monotonic() - admission.dispatched_at, 4))
            admission = await self.flow.acquire(request, exclude=frozenset(tried))

    async def _started_by(self, stream: AsyncIterator[RequestOutput], request: GenerateRequest,
                          replica: str) -> AsyncIterator[RequestOutput]:
        """The replica's stream, whose first output must come before the client's deadline.

        A request dispatched into an engine's own queue is still waiting, so the `timeout` its
        client set still holds there: past it the client has given up, and the work is waste.
        A band's default deadline only bounds the gateway's queue: an operator sets it as a queue
        budget, and aborting a started prefill would waste it. Once tokens flow, neither applies.
        The engine holds the same deadline (in its own clock): one that passes while the request
        still waits in the engine's queue ends it there, unprefilled, with `DeadlineExceededError`,
        answered here exactly as the gateway's own timer would."""
        if request.deadline is not None:
            try:
                first = await asyncio.wait_for(anext(stream), max(0.0, request.deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except (TimeoutError, DeadlineExceededError):
                metrics.REJECTIONS.labels(self.name, "deadline").inc()
                waited = time.monotonic() - request.timeline.stamps["received"]
                raise DeadlineExceededError(
                    f"request passed its deadline after {waited:.1f}s, before its first token on "
                    f"replica '{replica}' of model '{self.name}'", code="deadline_exceeded") from None
            yield first
        async for out in stream:
            yield out


class ModelRouter:
    def __init__(
        self,
        deployments: Sequence[Deployment],
        aliases: dict[str, str] | None = None,
        fallbacks: dict[str, list[str]] | None = None,
    ) -> None:
        self.deployments = {d.name: d for d in deployments}
        self.aliases = dict(aliases or {})
        self.fallbacks = {k: list(v) for k, v in (fallbacks or {}).items()}
        # LoRA adapters by the name clients send (vLLM's --lora-modules, /v1/load_lora_adapter):
        # each runs on its base deployment, whose requests then carry it to the engine.
        self.adapters: dict[str, LoraRef] = {}
        for alias, target in self.aliases.items():
            if target not in self.deployments:
                raise ValueError(f"alias '{alias}' points at unknown deployment '{target}'")
            if alias in self.deployments:
                raise ValueError(f"alias '{alias}' shadows a deployment of the same name")
        for name, chain in self.fallbacks.items():
            dep = self.deployments.get(name)
            if dep is None:
                raise ValueError(f"fallbacks given for unknown deployment '{name}'")
            resolved = []
            for fb in chain:
                target = self.deployments.get(self.aliases.get(fb, fb))
                if target is None:
                    raise ValueError(f"fallback '{fb}' of '{name}' is not a deployment")
                if target is dep or target.task != dep.task:
                    raise ValueError(f"fallback '{fb}' of '{name}' must be another {dep.task} deployment")
                resolved.append(target)
            dep.fallbacks = resolved

    def names(self) -> list[str]:
        return list(self.deployments)

    def add_adapter(self, ref: LoraRef) -> None:
        """Register an adapter (already checked) under a name no model or alias has."""
        if ref.name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{ref.name}' has already been loaded.", param="lora_name",
                                      code="lora_already_loaded")
        if ref.name in self.deployments or ref.name in self.aliases:
            raise InvalidRequestError(f"'{ref.name}' is already the name of a model; pick another lora_name",
                                      param="lora_name")
        base = self.deployments.get(ref.base)
        if base is None or base.task == "embedding":
            raise InvalidRequestError(f"base model '{ref.base}' is not a chat model served here", param="base_model_name")
        self.adapters[ref.name] = ref

    def remove_adapter(self, name: str) -> LoraRef:
        """Unregister: new requests naming it get a 404; running ones keep their adapter and finish."""
        ref = self.adapters.pop(name, None)
        if ref is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                code="lora_not_found")
        return ref

    def adapter(self, model: str) -> LoraRef | None:
        return self.adapters.get(model)

    def resolve(self, model: str, task: str) -> Deployment:
        """Name (or alias, or LoRA adapter: its base) -> deployment; 404 for an unknown name, 400
        when it cannot do the task."""
        ref = self.adapters.get(model)
        name = ref.base if ref is not None else self.aliases.get(model, model)
        dep = self.deployments.get(name)
        if dep is None:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")
        if not dep.serves(task):
            use = {"embedding": "/v1/embeddings", "chat": "/v1/chat/completions", "completion": "/v1/completions"}
            article = "an" if dep.task[0] in "aeiou" else "a"
            raise InvalidRequestError(
                f"The model '{model}' is {article} {dep.task} model and cannot serve {task} requests; send it to "
                f"{use[dep.task]}, or pick a {task} model from /v1/models", param="model"
            )
        return dep

    async def close(self) -> None:
        for dep in self.deployments.values():
            if dep._flow is not None:
                await dep._flow.close()
