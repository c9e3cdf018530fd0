"""One HTTP request's record, and its single, certain ending.

The intake's stages (`api/intake.py`: authenticated, routed, priced, tokenized, submitted) are
recorded here as each is reached, once; this module reads them only to end the request.

`RequestRun.finish()` reconciles the token reservation, writes the audit record, observes the
metrics and records the trace exactly once, whichever way the request ended: success, a typed
error, a client disconnect, a shutdown abort or an unexpected exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from tokenpath.api.errors import error_response
from tokenpath.api.formatting import Accumulator
from tokenpath.api.intake import (
    MODEL_CHARS,
    Authenticated,
    Priced,
    Routed,
    Stage,
    Submitted,
    Tokenized,
    authenticate,
)
from tokenpath.api.limits import UPLOAD_KEY
from tokenpath.api.sse import STALLED, Interrupted, StopSignal
from tokenpath.api.state import AppState
from tokenpath.config import env_audit_text
from tokenpath.errors import TokenpathError
from tokenpath.gateway.base import AuditRecord, Principal
from tokenpath.telemetry.otel import begin_trace
from tokenpath.telemetry.publish import publish
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.stages import after_first_token
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.api")
S = TypeVar("S", bound=Stage)

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
            await authenticate(run)
        model = body.get("model") if isinstance(body, dict) else None
        run.model = model[:MODEL_CHARS] if isinstance(model, str) else None
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
        self.model: str | None = None  # the name the request gave, kept even when routing refused it
        # The intake's stages (`api/intake.py`), each recorded once reached (`reached`): read by the
        # ending alone, never by another stage.
        self.authenticated: Authenticated | None = None
        self.routed: Routed | None = None
        self.priced: Priced | None = None
        self.tokenized: Tokenized | None = None
        self.submitted: Submitted | None = None
        self.status = 200
        self.error_type: str | None = None
        self.prompt_tokens = 0  # for embeddings (generation counts come from the accumulator)
        self.extra_headers: dict[str, str] = {}  # e.g. the fields accepted as no-ops (api/openai_fields.py)
        self.token_times: list[float] = []
        self.stop = StopSignal()
        self._finished = False
        self.error_code: str | None = None
        self.audit_key = uuid.uuid4().hex  # ties the audit row opened at admission to its close
        # The open row's write (`intake.tokenize` starts it, `intake.recorded` awaits it before a
        # reply's first byte); `finish` awaits it before the close, so a close is never overwritten.
        self.audit_opening: asyncio.Task[None] | None = None
        begin_trace(self.timeline, request.headers)
        state.live.started(self.timeline, endpoint, self.token_times)  # (the same list, as it grows)

    def reached(self, stage: S) -> S:
        """Record a stage of the intake (`api/intake.py`) as reached, once, for the ending: the
        audit row, telemetry and the reconcile read what the request got to. Returns `stage`."""
        name = type(stage).__name__.lower()
        if getattr(self, name) is not None:
            raise RuntimeError(f"{self.id}: the {name} stage was reached twice")
        setattr(self, name, stage)
        return stage

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
        out = dict(self.priced.reservation.headers) if self.priced else {}
        out.update(self.extra_headers)
        out["x-request-id"] = self.id  # the server's id, as OpenAI's API answers
        if self.client_id is not None:
            out["x-client-request-id"] = self.client_id
        if timing:
            out["server-timing"] = self.timeline.server_timing()
        return out

    @property
    def acc(self) -> Accumulator | None:
        """The reply's accumulator, once the run is submitted (for the ending's counts)."""
        return self.submitted.acc if self.submitted else None

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
        if self.routed is not None and self.routed.release is not None:
            self.routed.release()
        self.done()
        if self.stop.reason == STALLED:
            self.stalled()
        finish_reason = self.acc.finish_reason() if self.acc else None
        if self.status == CLIENT_CLOSED:
            finish_reason = STALLED if self.error_type == STALLED else "abort"
        prompt, completion = self.total_prompt_tokens, self.completion_tokens
        guard = self.state.guard
        if self.priced is not None:
            try:
                await guard.reconcile(self.priced.reservation, prompt + completion)
            except Exception:
                log.exception("reconcile failed for %s", self.id)
        durations = self.timeline.durations()
        record = self._finished_record(finish_reason, prompt, completion)
        if self.audit_opening is not None:  # the open first: a close written before it would be reopened
            try:
                await asyncio.shield(self.audit_opening)
            except Exception as exc:  # (the request's own error when `recorded` raised it)
                log.error("audit row open failed for %s: %s: %s", self.id, type(exc).__name__, exc)
        try:
            await guard.audit(self.audit_record(finish_reason, prompt, completion, durations, record))
        except Exception:
            log.exception("audit failed for %s", self.id)
        publish(record, self.state.metrics, self.state.live)

    def _finished_record(self, finish_reason: str | None, prompt: int, completion: int) -> FinishedRequest:
        """What telemetry (spans, log line, metrics, dashboard) is told about this request."""
        p, url = self._principal(), self.request.url
        sp = self.tokenized.params if self.tokenized else None
        text = env_audit_text()  # prompt/completion text leaves the process only when the operator asked
        priority = self.timeline.attrs.get("priority")  # (an int, set by `priority()`, or absent)
        return FinishedRequest(
            timeline=self.timeline, endpoint=self.endpoint, status=self.status, requested_model=self.model,
            derive_causes=self.state.config.causes,
            model=self.routed.deployment.name if self.routed else None, error_type=self.error_type,
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
            prompt_text=self._prompt_text() if text else None,
            completion_text="\n".join(c.text for c in self.acc.sorted()) if text and self.acc else None,
        )

    def _principal(self) -> Principal | None:
        return self.authenticated.principal if self.authenticated else None

    def _prompt_text(self) -> str | None:
        """The prompt's text, once tokenized (the gateway keeps it only when text logging is on)."""
        return self.tokenized.prompt_text if self.tokenized else None

    def audit_record(self, finish_reason: str | None, prompt: int, completion: int,
                     durations: dict[str, float], record: FinishedRequest | None) -> AuditRecord:
        """The audit row as of now: opened by the intake (`intake.tokenize`), closed by `finish`."""
        p = self._principal()
        client = self.request.client
        return AuditRecord(
            request_id=self.id,
            time=self.timeline.wall_start,
            tenant=p.tenant if p else "anonymous",
            key_prefix=p.key_prefix if p else None,
            model=self.routed.deployment.name if self.routed else self.model,
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
            prompt_text=self._prompt_text(),
            completion_text="\n".join(c.text for c in self.acc.sorted()) if self.acc else None,
            timing=json.dumps(record.timing_summary()) if record is not None else None,
            audit_key=self.audit_key,
            client_request_id=self.client_id,
        )
