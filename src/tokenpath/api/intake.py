"""The intake: one request's way from its headers to the engine, as a typed pipeline.

Each stage is a function that takes the previous stage's value and returns its own, an immutable
value; a stage cannot run before the one it follows, because it has nothing to run on (mypy holds
every caller to it). In order, with the Timeline stamp each owns:

1. `authenticate` -> `Authenticated`: the key, the tenant. Stamps `authenticated` (attr `tenant`).
2. `route` -> `Routed`: the model name to its deployment (a catalog model loaded first, held until
   the run finishes), and the LoRA adapter it names. Stamps `routed` (attrs `deployment`, `lora`,
   `lora_base`); the router stamps `awaiting_model`/`model_loaded` inside it.
3. `price` -> `Priced`: the priority (`x-priority`), admission's precheck, and the rate limits
   charged on a fast estimate, before anything is tokenized. No stamp (attr `priority`).
4. `tokenize` -> `Tokenized`: the prompt's token ids (tokenized by the endpoint), the policy hook,
   the reservation made exact, the audit row's open write started (it runs beside the dispatch;
   `recorded` awaits it before a reply's first byte). Stamps `tokenized`.
5. `submit` -> `Submitted`: the engine's requests, the run registered in flight, the reply's
   accumulator. No stamp: admission owns `admitted`, `dequeued` and `dispatched`.

Embeddings (and /v1/score, /v1/rerank) run stages 1-4 and send `embedding_request(tokenized)`;
/tokenize, /detokenize and /v1/messages/count_tokens run stages 1-2. Chat, completions and the
Responses and Messages edges run all five (`api/generation.py`).

The per-request record (`api/run.py`, `RequestRun`) keeps each stage's value once it is reached,
for the ending only (audit, telemetry, reconcile); no stage reads it: each takes what it needs as
an argument. Between stages, an endpoint does its own checks (caps, constraints, the tokenizer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenpath.api.formatting import Accumulator
from tokenpath.config import parse_duration
from tokenpath.errors import InvalidRequestError
from tokenpath.gateway.base import OPEN_STATUS, Principal, Reservation
from tokenpath.protocol import EmbeddingRequest as EmbeddingJob
from tokenpath.protocol import GenerateRequest, SamplingParams, Submission
from tokenpath.protocol.limits import PRIORITY
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.names import MODEL, check_name
from tokenpath.protocol.requests import check_priority
from tokenpath.routing.models import Deployment

if TYPE_CHECKING:
    from tokenpath.api.run import RequestRun

MODEL_CHARS = 256  # a requested `model`, as kept in the record (metrics bound it to served names)


@dataclass(frozen=True)
class Authenticated:
    """Stage 1: who asks."""

    principal: Principal


@dataclass(frozen=True)
class Routed:
    """Stage 2: where it runs. `release`: the catalog model's hold, dropped when the run finishes
    (None: not a catalog model)."""

    who: Authenticated
    model: str  # the name the request gave (at most MODEL_CHARS)
    deployment: Deployment[Any, Any]
    lora: LoraRef | None  # the adapter `model` named: it runs on its base deployment
    release: Callable[[], None] | None

    @property
    def served_name(self) -> str:
        """The name replies carry: a LoRA adapter answers under its own name, as vLLM's do."""
        return self.lora.name if self.lora is not None else self.deployment.name


@dataclass(frozen=True)
class Priced:
    """Stage 3: how urgent, by when, and the rate limits charged on an estimate."""

    routed: Routed
    priority: int
    deadline: float | None
    reservation: Reservation


@dataclass(frozen=True)
class Tokenized:
    """Stage 4: the prompts as token ids (one list per prompt, or per embedding input), their
    texts, the sampling parameters (None for embeddings, which sample nothing), and the exact
    count the limits now hold."""

    priced: Priced
    prompts: tuple[list[int], ...]
    texts: tuple[str, ...]
    params: SamplingParams | None
    prompt_tokens: int
    charged: int

    @property
    def prompt_text(self) -> str:
        return "\n".join(self.texts)


@dataclass(frozen=True)
class Submitted:
    """Stage 5: the engine's requests (one per prompt) and the accumulator their replies fill."""

    tokenized: Tokenized
    params: SamplingParams
    acc: Accumulator
    requests: tuple[Submission[GenerateRequest], ...]

    @property
    def routed(self) -> Routed:
        return self.tokenized.priced.routed


Stage = Authenticated | Routed | Priced | Tokenized | Submitted
ORDER: tuple[type, ...] = (Authenticated, Routed, Priced, Tokenized, Submitted)  # (the docstring's order)


async def authenticate(run: RequestRun) -> Authenticated:
    principal = await run.state.guard.authenticate(run.request.headers)
    run.timeline.stamp("authenticated", tenant=principal.tenant)
    return run.reached(Authenticated(principal))


async def route(run: RequestRun, who: Authenticated, model: str, task: str, timeout: float | None = None,
                keep_alive: str | float | None = None) -> Routed:
    """The model's deployment; a catalog model not loaded is loaded first (the request waits,
    under its `timeout`, in the `model_load` stage), and held until the run finishes (never
    evicted while this request runs). `keep_alive`: Ollama's field, how long the model stays
    loaded once idle. The name is recorded first: a refused one is still in the audit row."""
    run.model = name = model[:MODEL_CHARS]
    check_name(model, MODEL, "model")  # no served name holds a control character: a 400, not a 404 echoing it
    state = run.state
    state.guard.check_model(who.principal, model)
    keep_s = None
    if keep_alive is not None:
        try:
            keep_s = parse_duration(keep_alive)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="keep_alive") from None
    deadline = None if timeout is None else run.timeline.stamps["received"] + timeout
    deployment, release = await state.router.acquire(model, task, run.timeline, deadline, keep_s, run.stop.set)
    lora = state.router.adapter(model)
    routed = run.reached(Routed(who, name, deployment, lora, release))
    run.timeline.stamp("routed", deployment=deployment.name)
    if lora is not None:
        run.timeline.attrs.update(lora=lora.name, lora_base=deployment.name)
    return routed


def priority(run: RequestRun, principal: Principal) -> int:
    """The principal's priority, or a worse-or-equal one it asks for with `x-priority` (lower is
    more urgent; nobody may ask for better than their key's `max_priority`)."""
    raw = run.request.headers.get("x-priority")
    if raw is None:
        value = principal.priority
    else:
        try:
            asked = int(raw) if len(raw) <= 16 else None  # (no int() of a megabyte of digits)
        except ValueError:
            asked = None
        if asked is None:
            raise InvalidRequestError(f"x-priority must be an integer between {PRIORITY.least} and {PRIORITY.value}, got "
                                      f"{raw[:32]!r}", param="x-priority")
        value = max(check_priority(asked, "x-priority"), principal.max_priority)
    run.timeline.attrs["priority"] = value
    return value


async def price(run: RequestRun, routed: Routed, estimate: int, deadline: float | None = None) -> Priced:
    """Admission's precheck, then the rate limits charged on a fast estimate (prompt bytes / 4),
    before the prompt is tokenized: a request refused either way costs the server no tokenizing.
    `tokenize` makes the charge exact."""
    principal = routed.who.principal
    level = priority(run, principal)
    routed.deployment.precheck(level, principal.tenant, run.timeline.stamps["received"], deadline)
    reservation = await run.state.guard.reserve(principal, routed.deployment.name, estimate)
    return run.reached(Priced(routed, level, deadline, reservation))


async def tokenize(run: RequestRun, priced: Priced, prompts: list[list[int]], texts: list[str], charge: int,
                   prompt_tokens: int, params: SamplingParams | None = None) -> Tokenized:
    """The endpoint's token ids, recorded (the audit row keeps the prompt's text even when the
    policy refuses it); then the policy hook on the text, the reservation re-sized to `charge`, the
    exact count (re-decided when it grows, so token limits stay exact), and the audit row's open
    write started. It runs beside the dispatch, off the request's path to its first token (a
    thread hop and a commit: 0.4 ms on a quiet machine, several on busy cores, where the thread
    waits for the GIL); the endpoint awaits it (`recorded`) before its reply's first byte, so no
    reply reaches a client unrecorded, and a write that fails fails the request with no token
    sent. A gateway that dies once a token was sent leaves a row the next start closes as
    `gateway_crash`.

    It stamps `tokenized`, not `admitted`: admission (`FlowController.acquire`) owns that event
    and stamps it when it admits or queues the request, so the `gateway` stage runs up to that
    decision and a request admission refuses (429/503) ends in `gateway`."""
    run.timeline.stamp("tokenized")
    tokenized = run.reached(Tokenized(priced, tuple(prompts), tuple(texts), params, prompt_tokens, charge))
    guard = run.state.guard
    await guard.check_policy(priced.routed.who.principal, list(texts))
    await guard.adjust(priced.reservation, charge)
    run.audit_opening = asyncio.create_task(_open_row(run, prompt_tokens), name=f"audit-open-{run.id}")
    return tokenized


async def _open_row(run: RequestRun, prompt_tokens: int) -> None:
    """The audit row's open write, its record built here, in the task: the task's first step runs
    when the request's own task first waits, which is for the replica once the request is sent to
    it, so building the record (tens of microseconds of a URL replica's added TTFT: issue 37) is
    off the path to the backend. The row is what it was when `tokenize` started it: nothing the
    request reached since (its accumulator, an early error that `finish` records in the close)."""
    opened = run.audit_record(None, prompt_tokens, 0, {}, None)
    opened.status, opened.error_type, opened.cached_tokens, opened.completion_text = OPEN_STATUS, None, 0, None
    await run.state.guard.audit_open(opened, lambda: run.completion_tokens)


async def recorded(run: RequestRun) -> None:
    """Wait for the audit row's open write that `tokenize` started: before a reply's first byte
    leaves (the first token of a stream, a whole body), so no reply reaches a client unrecorded.
    Its failure is raised here, the request's own, as when the write was awaited before dispatch.
    Shielded: a request cancelled while it waits does not cancel the write (`finish` awaits it)."""
    if run.audit_opening is not None:
        await asyncio.shield(run.audit_opening)


def session_id(run: RequestRun, prompt_cache_key: str | None, user: str | None) -> str | None:
    """Session affinity, what a replica picker keeps together: an explicit x-session-id, else
    OpenAI's `prompt_cache_key` (what OpenAI routes its own prompt cache by), else its `user`."""
    return run.request.headers.get("x-session-id") or prompt_cache_key or user


def _traceparent(run: RequestRun) -> str | None:
    """The trace context the engine continues (the gateway's dispatch span, when tracing is on)."""
    value = run.timeline.attrs.get("traceparent")
    return str(value) if value else None


def generate_request(run: RequestRun, tokenized: Tokenized, params: SamplingParams, i: int,
                     session: str | None) -> Submission[GenerateRequest]:
    """Prompt `i`'s `GenerateRequest`, in a submission with the run's Timeline (one record for every
    prompt of the run), the prompt's text and the session id."""
    priced, parts, texts = tokenized.priced, len(tokenized.prompts), tokenized.texts
    request = GenerateRequest(
        request_id=run.id if parts == 1 else f"{run.id}-{i}",
        prompt_token_ids=tokenized.prompts[i],
        params=params,
        priority=priced.priority,
        tenant=priced.routed.who.principal.tenant,
        deadline=priced.deadline,
        traceparent=_traceparent(run),
        operation="text_completion" if run.endpoint == "/v1/completions" else "chat",
        lora=priced.routed.lora,
    )
    return Submission(request, run.timeline, prompt=texts[i] if i < len(texts) else None, session_id=session)


def submit(run: RequestRun, tokenized: Tokenized, params: SamplingParams, acc: Accumulator,
           session: str | None = None) -> Submitted:
    """The engine's requests, one per prompt, with the run registered in flight (so a shutdown or
    an abort by id reaches it). The deployment is asked once the caller iterates them.
    `session`: `session_id`'s."""
    requests = tuple(generate_request(run, tokenized, params, i, session) for i in range(len(tokenized.prompts)))
    run.state.inflight[run.id] = run.stop
    return run.reached(Submitted(tokenized, params, acc, requests))


def embedding_request(run: RequestRun, tokenized: Tokenized, session: str | None = None) -> Submission[EmbeddingJob]:
    """The run's `EmbeddingRequest` of its token-id inputs, in a submission with its Timeline and
    session id (`session_id`'s)."""
    priced = tokenized.priced
    request = EmbeddingJob(request_id=run.id, inputs=list(tokenized.prompts), priority=priced.priority,
                           tenant=priced.routed.who.principal.tenant, traceparent=_traceparent(run))
    return Submission(request, run.timeline, session_id=session)
