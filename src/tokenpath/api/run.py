"""One HTTP request's walk through the guard and the router, and its single, certain ending.

`RequestRun.finish()` reconciles the token reservation, writes the audit record, observes the
metrics and records the trace exactly once, whichever way the request ended: success, a typed
error, a client disconnect, a shutdown abort or an unexpected exception.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from tokenpath.api.errors import error_response
from tokenpath.api.formatting import Accumulator
from tokenpath.api.limits import UPLOAD_KEY
from tokenpath.api.sse import STALLED, Interrupted, StopSignal
from tokenpath.api.state import AppState
from tokenpath.config import env_audit_text, parse_duration
from tokenpath.errors import InvalidRequestError, TokenpathError
from tokenpath.gateway.base import OPEN_STATUS, AuditRecord, Principal, Reservation
from tokenpath.protocol import SamplingParams
from tokenpath.protocol.limits import PRIORITY
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.names import MODEL, check_name
from tokenpath.protocol.requests import check_priority
from tokenpath.routing.models import Deployment
from tokenpath.telemetry.otel import begin_trace
from tokenpath.telemetry.publish import publish
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.stages import after_first_token
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.api")

CLIENT_CLOSED = 499  # nginx's "client closed request": only ever seen in the audit log
# A client's own id (`x-request-id`, as nginx and Envoy send it, or OpenAI's `X-Client-Request-Id`,
# which its SDKs let users set) is kept beside the server's as `client_request_id` when it looks like
# an id; anything else is dropped rather than logged as is. It is never the server's id: clients
# choose it, so two tenants (or one client reusing it) may send the same one.
_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
CLIENT_ID_HEADERS = ("x-client-request-id", "x-request-id")


# The request endpoints (each answered through a RequestRun) and the prefix of the ids they mint.
ID_PREFIXES = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl", "/v1/embeddings": "embd",
               "/tokenize": "tok", "/detokenize": "tok", "/v1/messages": "msg_", "/v1/messages/count_tokens": "msg_",
               "/v1/responses": "resp_", "/v1/score": "score", "/v1/rerank": "rerank"}
_MODEL_CHARS = 256  # a refused body's `model`, as kept in the audit row (metrics bound it to served names)


async def refuse_early(state: AppState, request: Request, error: TokenpathError, body: object = None) -> Response:
    """A request to a request endpoint refused before its route ran: its body by the schema
    (FastAPI's validation: an unknown field, malformed JSON), or its headers or body by their
    limits (`api.limits`: 431, 413, 408). It gets the same RequestRun ending as a refusal inside
    the route (a request log line, an audit row, `requests_total`), so a client sending a field the
    server does not know shows up on the server, not only in the client's own error. The key is
    checked only to name the tenant; the refusal is the answer either way (the cheapest checks
    come before the key). `body`: the parsed body, if any, for the `model` it names."""
    prefix = ID_PREFIXES.get(request.url.path)
    if prefix is None:
        return error_response(error)
    run = RequestRun(state, request, request.url.path, prefix)
    try:
        with contextlib.suppress(TokenpathError):
            await run.authenticate()
        model = body.get("model") if isinstance(body, dict) else None
        run.model = model[:_MODEL_CHARS] if isinstance(model, str) else None
        return run.respond_to(error)
    finally:
        await run.finish()


def new_request_id(prefix: str) -> str:
    """The server's id of one request, `<prefix>-<uuid hex>` (`<prefix><uuid hex>` for a prefix
    ending in '_', as Anthropic's `msg_` ids): unique, whatever clients send, so an engine, an
    abort, an audit row or a trace by this id is this request's and no other's."""
    return f"{prefix}{uuid.uuid4().hex}" if prefix.endswith("_") else f"{prefix}-{uuid.uuid4().hex}"


def client_request_id_of(request: Request) -> str | None:
    """The client's own id for the request: `X-Client-Request-Id` (OpenAI's), else `x-request-id`,
    when well formed; None otherwise."""
    for header in CLIENT_ID_HEADERS:
        given = request.headers.get(header)
        if given is not None and _CLIENT_ID.fullmatch(given):
            return given
    return None


class RequestRun:
    def __init__(self, state: AppState, request: Request, endpoint: str, id_prefix: str) -> None:
        self.state = state
        self.request = request
        self.endpoint = endpoint
        self.id = new_request_id(id_prefix)
        self.client_id = client_request_id_of(request)
        self.timeline = Timeline(self.id, client_request_id=self.client_id)
        upload = request.scope.get(UPLOAD_KEY)
        if upload is not None:  # the request began when its headers were in, not once its body was
            began, read, size = upload
            self.timeline.wall_start -= self.timeline.stamps["received"] - began
            self.timeline.stamps["received"] = began
            self.timeline.stamp("body_read", at=read, body_bytes=size)
        self.created = int(time.time())
        self.principal: Principal | None = None
        self.reservation: Reservation | None = None
        self.deployment: Deployment | None = None
        self.model: str | None = None
        self.lora: LoraRef | None = None  # the LoRA adapter `model` named (it runs on its base deployment)
        self.status = 200
        self.error_type: str | None = None
        self.acc: Accumulator | None = None
        self.prompt_tokens = 0  # for embeddings (generation counts come from the accumulator)
        self.user: str | None = None  # OpenAI's `user` field
        self.session_key: str | None = None  # OpenAI's `prompt_cache_key`: session affinity (api/inputs.py)
        self.extra_headers: dict[str, str] = {}  # e.g. the fields accepted as no-ops (api/openai_fields.py)
        self.prompt_text: str | None = None  # the gateway keeps it only when text logging is on
        self.token_times: list[float] = []
        self.stop = StopSignal()
        self._finished = False
        self.error_code: str | None = None
        self.sampling: SamplingParams | None = None  # set once the body is validated (trace attributes)
        self.audit_key = uuid.uuid4().hex  # ties the audit row opened at admission to its close
        self._release: Callable[[], None] | None = None  # a catalog model's hold (routing.catalog), until finish
        begin_trace(self.timeline, request.headers)
        state.live.started(self.timeline, endpoint, self.token_times)  # (the same list, as it grows)

    # -- the guard, in its fixed order ------------------------------------------------------------
    async def authenticate(self) -> Principal:
        self.principal = await self.state.guard.authenticate(self.request.headers)
        self.timeline.stamp("authenticated", tenant=self.principal.tenant)
        return self.principal

    async def route(self, model: str, task: str, timeout: float | None = None,
                    keep_alive: str | float | None = None) -> Deployment:
        """The model's deployment; a catalog model not loaded is loaded first (the request waits,
        under its `timeout`, in the `model_load` stage), and held until `finish` (never evicted
        while this request runs). `keep_alive`: Ollama's field, how long the model stays loaded
        once idle."""
        assert self.principal is not None
        self.model = model[:_MODEL_CHARS]
        check_name(model, MODEL, "model")  # no served name holds a control character: a 400, not a 404 echoing it
        self.state.guard.check_model(self.principal, model)
        keep_s = None
        if keep_alive is not None:
            try:
                keep_s = parse_duration(keep_alive)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="keep_alive") from None
        deadline = None if timeout is None else self.timeline.stamps["received"] + timeout
        self.deployment, self._release = await self.state.router.acquire(model, task, self.timeline, deadline, keep_s,
                                                                         self.stop.set)
        self.lora = self.state.router.adapter(model)
        self.timeline.stamp("routed", deployment=self.deployment.name)
        if self.lora is not None:
            self.timeline.attrs.update(lora=self.lora.name, lora_base=self.deployment.name)
        return self.deployment

    def priority(self) -> int:
        """The principal's priority, or a worse-or-equal one it asks for with `x-priority` (lower is
        more urgent; nobody may ask for better than their key's `max_priority`)."""
        assert self.principal is not None
        raw = self.request.headers.get("x-priority")
        if raw is None:
            value = self.principal.priority
        else:
            try:
                asked = int(raw) if len(raw) <= 16 else None  # (no int() of a megabyte of digits)
            except ValueError:
                asked = None
            if asked is None:
                raise InvalidRequestError(f"x-priority must be an integer between {PRIORITY.least} and {PRIORITY.value}, got "
                                          f"{raw[:32]!r}", param="x-priority")
            value = max(check_priority(asked, "x-priority"), self.principal.max_priority)
        self.timeline.attrs["priority"] = value
        return value

    async def reserve(self, estimate: int) -> None:
        """Charge the rate limits on a fast estimate (prompt bytes / 4), before the prompt is
        tokenized: a key over its limits costs the server no tokenizing. `admit` makes it exact."""
        assert self.principal is not None and self.deployment is not None
        self.reservation = await self.state.guard.reserve(self.principal, self.deployment.name, estimate)

    async def admit(self, texts: list[str], tokens: int, prompt_tokens: int | None = None) -> None:
        """The policy hook on the prompt text, then the reservation re-sized to the exact count
        (re-decided when it grows, so token limits stay exact), then the audit row opened: a gateway
        that dies from here on leaves a row the next start closes as `gateway_crash`.

        It stamps `tokenized`, not `admitted`: admission (`FlowController.acquire`) owns that event
        and stamps it when it admits or queues the request, so the `gateway` stage runs up to that
        decision and a request admission refuses (429/503) ends in `gateway`."""
        assert self.principal is not None and self.deployment is not None
        self.timeline.stamp("tokenized")
        self.prompt_text = "\n".join(texts)
        await self.state.guard.check_policy(self.principal, texts)
        if self.reservation is None:
            self.reservation = await self.state.guard.reserve(self.principal, self.deployment.name, tokens)
        else:
            await self.state.guard.adjust(self.reservation, tokens)
        opened = self._audit_record(None, tokens if prompt_tokens is None else prompt_tokens, 0, {}, None)
        opened.status, opened.completion_text = OPEN_STATUS, None
        await self.state.guard.audit_open(opened, lambda: self.completion_tokens)

    # -- endings ----------------------------------------------------------------------------------
    def fail(self, exc: TokenpathError) -> None:
        self.status = exc.status_code
        self.error_type = exc.error_type
        self.error_code = exc.code

    def disconnected(self) -> None:
        self.status = CLIENT_CLOSED
        self.error_type = self.error_code = "client_disconnected"

    def stalled(self) -> None:
        """The client stopped reading its stream and the server ended it (`SSEResponse`): recorded
        like a disconnect (499, nginx's client-closed), with a reason of its own."""
        self.status = CLIENT_CLOSED
        self.error_type = self.error_code = STALLED

    def respond_to(self, exc: Exception) -> Response:
        """The response for whatever ended the request early, recorded for `finish`: a client that
        left gets nothing, a typed error its OpenAI body, anything else is re-raised as a 500."""
        if isinstance(exc, Interrupted):  # the client left before anything was sent
            self.disconnected()
            return Response(status_code=self.status)
        if isinstance(exc, TokenpathError):
            self.fail(exc)
            self.done()  # so Server-Timing, the log line and the audit row agree
            return error_response(exc, self.headers(timing=True))
        self.status, self.error_type = 500, "internal_error"
        raise exc

    def headers(self, *, timing: bool = False) -> dict[str, str]:
        out = dict(self.reservation.headers) if self.reservation else {}
        out.update(self.extra_headers)
        out["x-request-id"] = self.id  # the server's id, as OpenAI's API answers
        if self.client_id is not None:
            out["x-client-request-id"] = self.client_id
        if timing:
            out["server-timing"] = self.timeline.server_timing()
        return out

    @property
    def completion_tokens(self) -> int:
        return self.acc.completion_tokens if self.acc else 0

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.acc.prompt_tokens.values()) if self.acc else self.prompt_tokens

    def done(self) -> None:
        """The request is over for its client: `finished` is stamped (first wins). The API's only
        writer of it: the replica boundary (replica/events.py) stamps it first in the common case,
        on receipt of the last output; this ends every request that has none (an error, a batch
        of prompts, the usage chunk after them, an embedding) before its timing is reported."""
        self.timeline.stamp("finished")

    async def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.state.inflight.pop(self.id, None)
        if self._release is not None:
            self._release()
        self.done()
        if self.stop.reason == STALLED:
            self.stalled()
        finish_reason = self.acc.finish_reason() if self.acc else None
        if self.status == CLIENT_CLOSED:
            finish_reason = STALLED if self.error_type == STALLED else "abort"
        prompt, completion = self.total_prompt_tokens, self.completion_tokens
        guard = self.state.guard
        if self.reservation is not None:
            try:
                await guard.reconcile(self.reservation, prompt + completion)
            except Exception:
                log.exception("reconcile failed for %s", self.id)
        durations = self.timeline.durations()
        record = self._finished_record(finish_reason, prompt, completion)
        try:
            await guard.audit(self._audit_record(finish_reason, prompt, completion, durations, record))
        except Exception:
            log.exception("audit failed for %s", self.id)
        publish(record, self.state.metrics, self.state.live)

    def _finished_record(self, finish_reason: str | None, prompt: int, completion: int) -> FinishedRequest:
        """What telemetry (spans, log line, metrics, dashboard) is told about this request."""
        p, sp, url = self.principal, self.sampling, self.request.url
        text = env_audit_text()  # prompt/completion text leaves the process only when the operator asked
        priority = self.timeline.attrs.get("priority")  # (an int, set by `priority()`, or absent)
        return FinishedRequest(
            timeline=self.timeline, endpoint=self.endpoint, status=self.status, requested_model=self.model,
            derive_causes=self.state.config.causes,
            model=self.deployment.name if self.deployment else None, error_type=self.error_type,
            error_code=self.error_code, tenant=p.tenant if p else "anonymous", key_prefix=p.key_prefix if p else None,
            client_request_id=self.timeline.client_request_id,
            priority=priority if isinstance(priority, int) else None,
            prompt_tokens=prompt, completion_tokens=completion,
            cached_tokens=sum(self.acc.cached_tokens.values()) if self.acc else 0,
            finish_reasons=[finish_reason] if finish_reason else [],
            max_tokens=sp.max_tokens if sp else None, temperature=sp.temperature if sp else None,
            top_p=sp.top_p if sp else None, seed=sp.seed if sp else None,
            server_address=url.hostname, server_port=url.port,
            incoming_headers={k: v for k in ("traceparent", "tracestate") if (v := self.request.headers.get(k))},
            token_times=list(self.token_times),
            prompt_text=self.prompt_text if text else None,
            completion_text="\n".join(c.text for c in self.acc.sorted()) if text and self.acc else None,
        )

    def _audit_record(self, finish_reason: str | None, prompt: int, completion: int,
                      durations: dict[str, float], record: FinishedRequest | None) -> AuditRecord:
        p = self.principal
        client = self.request.client
        return AuditRecord(
            request_id=self.id,
            time=self.timeline.wall_start,
            tenant=p.tenant if p else "anonymous",
            key_prefix=p.key_prefix if p else None,
            model=self.deployment.name if self.deployment else self.model,
            endpoint=self.endpoint,
            status=self.status,
            finish_reason=finish_reason,
            prompt_tokens=prompt,
            cached_tokens=sum(self.acc.cached_tokens.values()) if self.acc else 0,
            completion_tokens=completion,
            queue_s=durations.get("queue"),
            prefill_s=durations.get("prefill"),
            decode_s=after_first_token(durations),
            total_s=durations.get("total"),
            client=client.host if client else None,
            error_type=self.error_type,
            prompt_text=self.prompt_text,
            completion_text="\n".join(c.text for c in self.acc.sorted()) if self.acc else None,
            timing=json.dumps(record.timing_summary()) if record is not None else None,
            audit_key=self.audit_key,
            client_request_id=self.client_id,
        )
