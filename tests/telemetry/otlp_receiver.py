"""A small OTLP/HTTP receiver on loopback, for tests: what a collector would get.

It decodes each `ExportTraceServiceRequest` (protobuf, on /v1/traces) with `opentelemetry-proto`
and keeps the spans as plain dicts: trace/span/parent ids as hex, times in ns, attributes as
Python values, events, the span kind name and the resource's `service.name`. Metrics (an
`ExportMetricsServiceRequest` on /v1/metrics) are kept as one dict per histogram data point:
name, unit, attributes, count, sum, bucket bounds and counts, temporality and service.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []  # histogram data points, every export appended
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path.rstrip("/").endswith("/v1/metrics"):
                    mreq = ExportMetricsServiceRequest()
                    mreq.ParseFromString(body)
                    receiver._add_metrics(mreq)
                    out = ExportMetricsServiceResponse().SerializeToString()
                else:
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    receiver._add(req, self.path)
                    out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, req: ExportTraceServiceRequest, path: str) -> None:
        with self._lock:
            self.requests += 1
            for rs in req.resource_spans:
                service = _attrs(rs.resource.attributes).get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex() or None, "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "kind": PbSpan.SpanKind.Name(s.kind),
                            "attributes": _attrs(s.attributes), "status": s.status.code,
                            "events": [{"name": e.name, "time": e.time_unix_nano, "attributes": _attrs(e.attributes)}
                                       for e in s.events],
                            "service": service, "path": path,
                        })

    def _add_metrics(self, req: ExportMetricsServiceRequest) -> None:
        with self._lock:
            for rm in req.resource_metrics:
                service = _attrs(rm.resource.attributes).get("service.name")
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.WhichOneof("data") != "histogram":
                            continue
                        for dp in m.histogram.data_points:
                            self.points.append({
                                "name": m.name, "unit": m.unit, "attributes": _attrs(dp.attributes),
                                "count": dp.count, "sum": dp.sum, "bounds": tuple(dp.explicit_bounds),
                                "buckets": tuple(dp.bucket_counts), "service": service,
                                "temporality": m.histogram.aggregation_temporality, "time": dp.time_unix_nano,
                            })

    def latest_points(self, name: str) -> list[dict[str, Any]]:
        """The newest data point of each attribute set of metric `name` (exports are cumulative)."""
        with self._lock:
            newest: dict[tuple, dict[str, Any]] = {}
            for p in self.points:
                if p["name"] == name:
                    key = tuple(sorted(p["attributes"].items()))
                    if key not in newest or p["time"] >= newest[key]["time"]:
                        newest[key] = p
            return list(newest.values())

    def start(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Spans matching `predicate`, once at least one arrived (batch export is asynchronous)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        return []
