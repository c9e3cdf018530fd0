"""Where a finished request goes: its spans, its log line, its metrics and the dashboard.

Called once per request from `RequestRun.finish()`. Each consumer is isolated: a failing
exporter or a full disk never changes the client's answer or stops the others.
"""

from __future__ import annotations

import logging

from tokenpath.telemetry.live import LiveRequests
from tokenpath.telemetry.metrics import ServerMetrics
from tokenpath.telemetry.otel_metrics import record_genai_metrics
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.request_log import log_request, request_fields
from tokenpath.telemetry.tracing import record_trace

log = logging.getLogger("tokenpath.telemetry")


def publish(rec: FinishedRequest, metrics: ServerMetrics, live: LiveRequests) -> None:
    fields: list[dict] = []  # the request line's fields, built once for the log line and the dashboard

    def shared() -> dict:
        if not fields:
            fields.append(request_fields(rec))
        return dict(fields[0])  # (a copy each: the dashboard's row drops and adds keys)

    steps = (("trace", lambda: record_trace(rec)), ("log", lambda: log_request(rec, shared)),
             ("metrics", lambda: metrics.observe_finished(rec)),
             ("otlp metrics", lambda: record_genai_metrics(rec, metrics.model_label(rec))),
             ("live", lambda: live.finished(rec, shared)))
    for what, step in steps:
        try:
            step()
        except Exception:
            log.exception("%s failed for %s", what, rec.request_id)
