"""Model routing: which deployment serves this model name, and the path inside a deployment.

A deployment is one served model name with a task (chat, completion, embedding) and one or more
replicas. Aliases map extra names onto a deployment (`gpt-4o-mini -> smollm2-135m-instruct`);
fallbacks name other deployments to try, in order, when one is down (503) or saturated (429).
The task check in `resolve` is what keeps an embedding request away from a chat engine.

`Deployment.generate` is the middle of the path (`Deployment.embed` takes it too, for an
`EmbeddingRequest` on an embedding model's replicas). It takes the gateway's `Submission`, stamps
its Timeline, and hands it to the replica, which sends the bare request on. A deployment is typed
by what its replicas serve (`Deployment[GenerateRequest, RequestOutput]`, or the embedding pair).
Admission (admit / queue / reject with Retry-After) -> fair queue -> replica pick (policy +
reason on the Timeline) -> replica stream.
A request that fails before its first token is retried once on another replica (the failed one
is ejected) when the failure is the replica's (`replica.base.replica_fault`: the engine or its
link gone); one raised for this request alone is a 500 `request_failed`, never retried and never
ejecting anything; after the first token a failure ends the stream with a 503, because tokens already
sent cannot be taken back. A stalled replica (`replica.liveness`) releases its requests the same
way, with the same request id; the Timeline keeps the first `dispatched` and records the retry
(`retried_after`, `retry_reason`, the replica that finished it). Closing the iterator aborts the
request wherever it is: it leaves the queue, or the replica is told to abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal

from tokenpath.admission.controller import Admission, AdmissionConfig, FlowController
from tokenpath.errors import (
    DeadlineExceededError,
    DuplicateRequestIdError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    RequestFailedError,
    ServiceUnavailableError,
    TokenpathError,
)
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, ReplicaState, Submission
from tokenpath.protocol.lora import LoraRef
from tokenpath.replica.base import (
    OutT,
    ProgressTimeoutError,
    Replica,
    ReplicaBusyError,
    ReplicaStalledError,
    ReqT,
    replica_fault,
)
from tokenpath.replica.events import stamp_events
from tokenpath.replica.pool import PoolConfig, ReplicaPool
from tokenpath.routing.replicas import DEFAULT_POLICY, PickerOptions, ReplicaPicker, make_picker
from tokenpath.telemetry import series as metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenpath.routing.catalog import ModelCatalog
    from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.routing")

Task = Literal["chat", "completion", "embedding"]
# A chat deployment also serves /v1/completions (same engine, no chat template).
_SERVES: dict[str, set[str]] = {"chat": {"chat", "completion"}, "completion": {"completion"},
                                "embedding": {"embedding"}}
MAX_ATTEMPTS = 2  # the first try plus one retry on another replica, before the first token only


@dataclass
class Deployment(Generic[ReqT, OutT]):
    name: str
    task: Task
    replicas: list[Replica[ReqT, OutT]] = field(default_factory=list)
    tokenizer: Any = None  # tokenpath.engine.tokenizer.Tokenizer (chat/completion) or the embedder's
    max_model_len: int = 2048
    dimensions: int = 0  # an embedding model's vector size (what `dimensions` in a request must equal)
    owned_by: str = "tokenpath"
    policy: str = DEFAULT_POLICY
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pool_config: PoolConfig = field(default_factory=PoolConfig)
    picker_options: PickerOptions = field(default_factory=PickerOptions)
    fallbacks: list[Deployment[ReqT, OutT]] = field(default_factory=list)  # filled in by ModelRouter
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

    async def close_flow(self) -> None:
        """Stop the flow controller if one was ever built (its pool's health checks and queue),
        without building one to close it: an unload or a shutdown, where the replicas go next."""
        if self._flow is not None:
            await self._flow.close()

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's own report (not the pool's ejection view): what `/health` shows."""
        return [h.raw_state() for h in self.flow.pool.handles.values()]

    def generate(self, submission: Submission[ReqT]) -> AsyncGenerator[OutT, None]:
        """Stream outputs for one request. Closing the iterator aborts the request wherever it is."""
        return self._run(submission)

    async def embed(self: Deployment[EmbeddingRequest, EmbeddingOutput],
                    submission: Submission[EmbeddingRequest]) -> EmbeddingOutput:
        """An embedding request down the same path as a generation (admission, queue, picker,
        retry, Timeline): one output. Cancelling it aborts the request wherever it is."""
        async with contextlib.aclosing(self.generate(submission)) as outputs:
            async for out in outputs:
                if out.finished:
                    return out
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

    async def _admit(self, submission: Submission[ReqT]) -> tuple[Deployment[ReqT, OutT], Admission]:
        """Admission on this deployment, then on each fallback in order, on 503/429 only."""
        first_error: TokenpathError | None = None
        for dep in (self, *self.fallbacks):
            try:
                admission = await dep.flow.acquire(submission)
            except (ServiceUnavailableError, RateLimitError) as exc:
                first_error = first_error or exc
                continue
            if dep is not self:
                submission.timeline.attrs.update(deployment=dep.name, fallback_from=self.name,
                                                 fallback_reason=first_error.code if first_error else None)
            return dep, admission
        assert first_error is not None
        raise first_error

    async def _run(self, submission: Submission[ReqT]) -> AsyncGenerator[OutT, None]:
        """Admission here or on a fallback (`dep`), then each attempt on a replica of `dep`: one
        generator from the replica's stream to the caller (a `generate` that only forwarded
        these outputs was one more step on every token's way, the first's included)."""
        timeline = submission.timeline
        timeline.stamp("routed", deployment=self.name, policy=self.policy)
        dep, admission = await self._admit(submission)
        tried: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            replica: Replica[ReqT, OutT] = admission.handle.replica
            tried.add(replica.name)
            stream = replica.generate(submission)
            started = finished = False
            # Whether the replica took this attempt on, so there is something of ours to abort. The
            # stream submits on its first step; a replica that refuses the id as already running
            # took nothing, and an abort by that id would stop the request that holds it.
            submitted = True
            failure: str | None = None
            retry_reason = "busy"
            try:
                async for out in dep._started_by(stream, submission, replica.name):
                    stamp_events(timeline, out)  # the one place engine events reach the Timeline
                    if not started:
                        dep.flow.started(admission)
                    elif admission.paused_by is not None:  # (yielded its slot to another tenant's)
                        dep.flow.resumed(admission)
                    started = True
                    finished = finished or out.finished
                    yield out
                if not finished:
                    raise ServiceUnavailableError(f"replica '{replica.name}' ended the stream early")
                return
            except DuplicateRequestIdError:
                submitted = False
                raise  # the request's own fault (a 400): no retry, no ejection
            except Exception as exc:
                if isinstance(exc, TokenpathError) and exc.status_code < 500:
                    raise  # the request's own fault: no retry, no ejection
                if isinstance(exc, DeadlineExceededError):
                    raise  # out of time, not a replica fault: no retry, no ejection
                if isinstance(exc, RequestFailedError):
                    raise  # it broke an engine step: retrying it would break the next replica too
                if not replica_fault(exc):  # raised for this request alone: its fault, never the replica's
                    log.error("request %s failed on replica %s: %s: %s", submission.request_id, replica.name,
                              type(exc).__name__, exc, exc_info=exc, extra={"event": "request_failed"})
                    raise RequestFailedError(f"request '{submission.request_id}' failed on replica '{replica.name}' "
                                             f"of model '{dep.name}': {type(exc).__name__}: {exc}",
                                             code="request_failed") from exc
                # A busy replica is retried elsewhere but not ejected; a stalled one has ejected itself
                # (and recovers the moment it is heard, with no backoff); anything else ejects it.
                released = exc if isinstance(exc, (ReplicaStalledError, ProgressTimeoutError)) else None
                failure = None if released or isinstance(exc, ReplicaBusyError) else f"{type(exc).__name__}: {exc}"
                retry_reason = (released.code if released else None) or failure or "busy"
                if started or attempt == MAX_ATTEMPTS:
                    if isinstance(exc, ServiceUnavailableError):
                        raise
                    raise ServiceUnavailableError(
                        f"replica '{replica.name}' of model '{dep.name}' failed: {exc}",
                        code="replica_failed") from exc
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()
                if submitted and not finished:
                    with contextlib.suppress(Exception):
                        await replica.abort(submission.request_id)
                dep.flow.release(admission, ok=finished, failure=failure)
            # Failed before the first token: once more, elsewhere.
            metrics.RETRIES.labels(dep.name).inc()
            timeline.attrs.update(retried_after=replica.name, retry_reason=retry_reason,
                                  retry_lost_s=round(time.monotonic() - admission.dispatched_at, 4))
            admission = await dep.flow.acquire(submission, exclude=frozenset(tried))

    def _started_by(self, stream: AsyncIterator[OutT], submission: Submission[ReqT],
                    replica: str) -> AsyncIterator[OutT]:
        """The replica's stream, whose first output must come before the client's deadline; without
        a deadline, the stream itself (one generator fewer for every chunk to pass through).

        A request dispatched into an engine's own queue is still waiting, so the `timeout` its
        client set still holds there: past it the client has given up, and the work is waste.
        A band's default deadline only bounds the gateway's queue: an operator sets it as a queue
        budget, and aborting a started prefill would waste it. Once tokens flow, neither applies.
        The engine holds the same deadline (in its own clock): one that passes while the request
        still waits in the engine's queue ends it there, unprefilled, with `DeadlineExceededError`,
        answered here exactly as the gateway's own timer would."""
        if submission.request.deadline is None:
            return stream
        return self._first_by(stream, submission, submission.request.deadline, replica)

    async def _first_by(self, stream: AsyncIterator[OutT], submission: Submission[ReqT], deadline: float,
                        replica: str) -> AsyncIterator[OutT]:
        """`stream`, its first output awaited until `deadline` (`_started_by`)."""
        try:
            first = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return
        except (TimeoutError, DeadlineExceededError):
            metrics.REJECTIONS.labels(self.name, "deadline").inc()
            waited = time.monotonic() - submission.timeline.stamps["received"]
            raise DeadlineExceededError(
                f"request passed its deadline after {waited:.1f}s, before its first token on "
                f"replica '{replica}' of model '{self.name}'", code="deadline_exceeded") from None
        yield first
        async for out in stream:
            yield out


class ModelRouter:
    def __init__(
        self,
        deployments: Sequence[Deployment[Any, Any]],
        aliases: dict[str, str] | None = None,
        fallbacks: dict[str, list[str]] | None = None,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.deployments = {d.name: d for d in deployments}
        # Models loaded on demand (routing.catalog): it adds and removes its deployments here.
        self.catalog = catalog
        if catalog is not None:  # (its models loaded so far, pinned ones at start, join the router's)
            self.deployments.update(catalog.deployments)
            catalog.deployments = self.deployments
        self.aliases = dict(aliases or {})
        self.fallbacks = {k: list(v) for k, v in (fallbacks or {}).items()}
        # LoRA adapters by the name clients send (vLLM's --lora-modules, /v1/load_lora_adapter):
        # each runs on its base deployment, whose requests then carry it to the engine.
        self.adapters: dict[str, LoraRef] = {}
        for alias, target in self.aliases.items():
            if target not in self.deployments and not (catalog is not None and target in catalog):
                raise ValueError(f"alias '{alias}' points at unknown deployment '{target}'")
            if alias in self.deployments:
                raise ValueError(f"alias '{alias}' shadows a deployment of the same name")
        for name, chain in self.fallbacks.items():
            dep = self.deployments.get(name)
            if dep is None:
                raise ValueError(f"fallbacks given for unknown deployment '{name}'")
            resolved = []
            for fb in chain:
                fallback = self.deployments.get(self.aliases.get(fb, fb))
                if fallback is None:
                    raise ValueError(f"fallback '{fb}' of '{name}' is not a deployment")
                if fallback is dep or fallback.task != dep.task:
                    raise ValueError(f"fallback '{fb}' of '{name}' must be another {dep.task} deployment")
                resolved.append(fallback)
            dep.fallbacks = resolved

    def names(self) -> list[str]:
        """Every model name served: the deployments, then the catalog's models not loaded now."""
        extra = [m for m in self.catalog.ids() if m not in self.deployments] if self.catalog is not None else []
        return list(self.deployments) + extra

    def task_of(self, name: str) -> str:
        """A served name's task (an alias's target's), loaded or not."""
        name = self.aliases.get(name, name)
        if name in self.deployments:
            return self.deployments[name].task
        if self.catalog is not None and name in self.catalog:
            return self.catalog.entry(name).task
        raise NotFoundError(f"The model '{name}' does not exist", param="model", code="model_not_found")

    async def acquire(self, model: str, task: str, timeline: Timeline | None = None, deadline: float | None = None,
                      keep_alive_s: float | None = None, stop: Callable[[str], None] | None = None,
                      ) -> tuple[Deployment[Any, Any], Callable[[], None] | None]:
        """`resolve`, loading a catalog model first when it is not loaded (waiting under the
        request's `deadline`), and the release to call when the request ends (None: not a
        catalog model). The task is checked before any load starts."""
        ref = self.adapters.get(model)
        name = ref.base if ref is not None else self.aliases.get(model, model)
        if self.catalog is None or name not in self.catalog:
            return self.resolve(model, task), None
        _check_task(model, self.catalog.entry(name).task, task)
        return await self.catalog.acquire(name, timeline, deadline, keep_alive_s, stop)

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

    def resolve(self, model: str, task: str) -> Deployment[Any, Any]:
        """Name (or alias, or LoRA adapter: its base) -> deployment; 404 for an unknown name, 400
        when it cannot do the task."""
        ref = self.adapters.get(model)
        name = ref.base if ref is not None else self.aliases.get(model, model)
        dep = self.deployments.get(name)
        if dep is None:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")
        _check_task(model, dep.task, task)
        return dep

    async def close(self) -> None:
        for dep in self.deployments.values():
            await dep.close_flow()


def _check_task(model: str, has: str, task: str) -> None:
    """A 400 when a model of task `has` cannot serve a `task` request, naming the right endpoint."""
    if task in _SERVES[has]:
        return
    use = {"embedding": "/v1/embeddings", "chat": "/v1/chat/completions", "completion": "/v1/completions"}
    article = "an" if has[0] in "aeiou" else "a"
    raise InvalidRequestError(
        f"The model '{model}' is {article} {has} model and cannot serve {task} requests; send it to "
        f"{use[has]}, or pick a {task} model from /v1/models", param="model"
    )
