"""The OpenTelemetry GenAI metrics, exported over OTLP beside the traces.

Prometheus (`metrics.py`, vLLM's names) is scraped; an OTLP backend wants the semantic
conventions' own instruments pushed to it. Each finished request is recorded once, from the
same `FinishedRequest` (and the same Timeline arithmetic) that feeds Prometheus, so the two
cannot disagree:

- `gen_ai.server.request.duration` (s): every request, `error.type` on failures;
- `gen_ai.server.time_to_first_token` (s) and `gen_ai.server.time_per_output_token` (s):
  completed generations (decode time over the tokens after the first, as vLLM's TPOT);
- `gen_ai.client.token.usage` ({token}, `gen_ai.token.type` input/output): the conventions have
  no server-side token histogram, and backends' GenAI views read this one.

Histograms use the conventions' recommended bucket boundaries. Attributes are bounded: the model
is the served one (`ServerMetrics.model_label`: never a name a client made up).

Off unless asked for, like tracing: `serve --otlp-endpoint URL`, or OTEL_METRICS_EXPORTER=otlp|
console (with the OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT / _PROTOCOL variables); the export
interval is the SDK's OTEL_METRIC_EXPORT_INTERVAL (ms, default 60000). Engine processes record
nothing here: the gateway sees every request once.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from tokenpath.telemetry.otel import install_provider, pick_exporter
from tokenpath.telemetry.otel_env import exporter_kind
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.stages import after_first_token
from tokenpath.telemetry.tracing import PROVIDER_NAME

DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


def setup_metrics(otlp_endpoint: str | None = None, *, service_name: str = "tokenpath",
                  exporter: MetricExporter | None = None) -> MeterProvider | None:
    """Install the process's MeterProvider when OTLP metrics are asked for; None when off.
    `exporter` is for embedders and tests (any MetricExporter, read periodically)."""
    kind = "custom" if exporter is not None else exporter_kind("metrics", otlp_endpoint)
    if kind == "none":
        return None
    if exporter is None:
        exporter = pick_exporter("metrics", kind, otlp_endpoint, ConsoleMetricExporter)
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = MeterProvider(resource=Resource.create(attrs), metric_readers=[PeriodicExportingMetricReader(exporter)])
    return install_provider(provider, metrics.set_meter_provider, metrics.get_meter_provider, "meter")


def meter_provider() -> MeterProvider | None:
    """The process's SDK provider when OTLP metrics are on, else None."""
    provider = metrics.get_meter_provider()
    return provider if isinstance(provider, MeterProvider) else None


def record_genai_metrics(rec: FinishedRequest, model: str, provider: MeterProvider | None = None) -> None:
    """Record one finished request (no-op when OTLP metrics are off). `model` is the bounded
    model label (`ServerMetrics.model_label`). The SDK hands back the same instruments on every
    call, so nothing is kept here between requests."""
    provider = provider or meter_provider()
    if provider is None:
        return
    meter = provider.get_meter("tokenpath")
    attrs: dict[str, Any] = {"gen_ai.operation.name": rec.operation, "gen_ai.provider.name": PROVIDER_NAME,
                             "gen_ai.request.model": model}
    if rec.model is not None:
        attrs["gen_ai.response.model"] = rec.model
    if rec.server_address is not None:
        attrs["server.address"] = rec.server_address
    if rec.server_port is not None:
        attrs["server.port"] = rec.server_port
    ok = rec.status in (200, 499) and rec.model is not None
    duration = dict(attrs)
    if not ok:
        duration["error.type"] = rec.error_code or rec.error_type or str(rec.status)
    meter.create_histogram("gen_ai.server.request.duration", unit="s",
                           description="GenAI server request duration (received to finished)",
                           explicit_bucket_boundaries_advisory=DURATION_BUCKETS).record(
        rec.timeline.durations()["total"], duration)
    if not ok:
        return
    usage = meter.create_histogram("gen_ai.client.token.usage", unit="{token}",
                                   description="Number of input and output tokens used",
                                   explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
    usage.record(rec.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
    if rec.operation == "embeddings":
        return
    usage.record(rec.completion_tokens, {**attrs, "gen_ai.token.type": "output"})
    ttft = rec.timeline.between("received", "first_token")
    if ttft is not None:
        meter.create_histogram("gen_ai.server.time_to_first_token", unit="s",
                               description="Time to generate the first token",
                               explicit_bucket_boundaries_advisory=TTFT_BUCKETS).record(ttft, attrs)
    decode = after_first_token(rec.stages())
    if decode is not None and rec.completion_tokens > 1:
        meter.create_histogram("gen_ai.server.time_per_output_token", unit="s",
                               description="Time per output token generated after the first",
                               explicit_bucket_boundaries_advisory=TPOT_BUCKETS).record(
            decode / (rec.completion_tokens - 1), attrs)
