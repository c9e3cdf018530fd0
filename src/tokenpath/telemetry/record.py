"""What telemetry is told about a request once it has ended: one typed record.

The API layer builds a `FinishedRequest` in `RequestRun.finish()` (the one place every request
ends, whatever way it ends); spans, the request log line, the metrics and the dashboard's
recent list are all derived from it and from its Timeline. It holds no secret: the key's short
prefix only, and prompt/completion text only when `TOKENPATH_AUDIT_TEXT=1` put it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpath.telemetry.causes import Cause, derive
from tokenpath.telemetry.stages import stage_durations, stage_ms
from tokenpath.telemetry.timeline import Timeline

# (status, error code) -> the rejection reason counted on /metrics; status alone when the code is free.
_REJECTION_BY_CODE = {
    "rate_limit_exceeded": "rate_limit", "quota_exceeded": "rate_limit",
    "queue_full": "admission", "tenant_queue_full": "admission", "no_healthy_replica": "admission",
    "deadline_unreachable": "deadline", "deadline_exceeded": "deadline",
}
_REJECTION_BY_STATUS = {401: "auth", 403: "acl", 504: "deadline"}


@dataclass
class FinishedRequest:
    timeline: Timeline
    endpoint: str  # "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank"...
    status: int
    requested_model: str | None = None
    model: str | None = None  # the deployment that served it
    error_type: str | None = None
    error_code: str | None = None
    tenant: str = "anonymous"
    key_prefix: str | None = None
    client_request_id: str | None = None  # the client's own id (x-request-id / X-Client-Request-Id), if sent
    priority: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    server_address: str | None = None
    server_port: int | None = None
    incoming_headers: dict[str, str] = field(default_factory=dict)  # traceparent/tracestate only
    # When each output token of the first choice reached the API (monotonic): ITL as clients see it,
    # the same whether the engine is in this process or behind a link.
    token_times: list[float] = field(default_factory=list)
    prompt_text: str | None = None
    completion_text: str | None = None
    derive_causes: bool = True  # False: `serve --no-causes` (causes() is empty)
    _causes: list[Cause] | None = field(default=None, init=False, repr=False)

    @property
    def request_id(self) -> str:
        return self.timeline.request_id

    @property
    def operation(self) -> str:
        """GenAI semconv's operation name."""
        if self.endpoint.endswith(("embeddings", "/score", "/rerank")):  # (score and rerank: embeddings)
            return "embeddings"
        return "chat" if "chat" in self.endpoint else "text_completion"

    @property
    def replica(self) -> str | None:
        r = self.timeline.attrs.get("replica")
        return None if r is None else str(r)

    @property
    def rejection_reason(self) -> str | None:
        """Why the gateway refused it (auth, acl, rate_limit, admission, deadline), if it did."""
        if self.status < 400 or self.status == 499:
            return None
        by_code = _REJECTION_BY_CODE.get(self.error_code or "")
        if by_code is not None and self.status in (400, 429, 503, 504):
            return by_code
        return _REJECTION_BY_STATUS.get(self.status)

    def causes(self) -> list[Cause]:
        """Why it took as long as it did (`tokenpath.telemetry.causes`), derived once."""
        if not self.derive_causes:
            return []
        if self._causes is None:
            self._causes = derive(self.timeline, prompt_tokens=self.prompt_tokens,
                                  cached_tokens=self.cached_tokens, token_times=self.token_times,
                                  completion_tokens=self.completion_tokens)
        return self._causes

    def stages(self) -> dict[str, float]:
        return stage_durations(self.timeline)

    def stage_ms(self) -> dict[str, float]:
        return stage_ms(self.timeline)

    def timing_summary(self) -> dict[str, object]:
        """What the audit row's `timing` column keeps for `tokenpath trace`: stage ms and the
        decisions that explain them."""
        a = self.timeline.attrs
        out: dict[str, object] = {"stages_ms": self.stage_ms()}
        for event in ("first_reasoning", "first_answer"):  # a reasoning model's: time to its first of each
            at = self.timeline.between("received", event)
            if at is not None:
                out[f"time_to_{event}_ms"] = round(at * 1000, 1)
        for key in ("replica", "policy", "reason", "admission", "matched_blocks", "trace_id", "fallback_from",
                    "retried_after", "preemptions", "grammar", "predicted_wait_s", "backend_timing",
                    "spec_decode", "client_stall", "admission_preempted", "admission_paused"):
            if a.get(key) is not None:
                out[key] = a[key]
        causes = self.causes()
        if causes:
            out["causes"] = [c.as_dict() for c in causes]
        if self.priority is not None:
            out["priority"] = self.priority
        if self.rejection_reason is not None:
            out["rejection"] = self.rejection_reason
        return out
