"""Setting up OpenTelemetry export, and choosing a request's trace ids when it arrives.

Tracing is off unless asked for: `serve --otlp-endpoint URL`, or the standard variables
(`OTEL_TRACES_EXPORTER=otlp|console|none`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER`/`_ARG`, `OTEL_SDK_DISABLED`). Spans leave through a `BatchSpanProcessor`
(export happens on its own thread, off the request path) with the OTLP/HTTP protobuf exporter.

Spans are built after a request ends, from its Timeline, but two ids must be known earlier: the
trace id (for the log line and for `traceparent` sent to a remote replica) and the dispatch
span's id (the parent a remote replica continues). `begin_trace` picks them when the request
arrives and `PresetIdGenerator` hands them to the SDK when the spans are built, so what was
sent outward and what is exported name the same spans.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenpath.telemetry.otel_env import exporter_kind
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.telemetry")
PROPAGATOR = TraceContextTextMapPropagator()
# The ids the next span(s) built in this context must take: (trace id or None, span id or None).
_PRESET: contextvars.ContextVar[tuple[int | None, int | None]] = contextvars.ContextVar(
    "tokenpath_preset_ids", default=(None, None))


class PresetIdGenerator(RandomIdGenerator):
    """Random ids, except inside `preset_ids(...)`, where the chosen ones are returned."""

    def generate_span_id(self) -> int:
        span_id = _PRESET.get()[1]
        return span_id if span_id is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id = _PRESET.get()[0]
        return trace_id if trace_id is not None else super().generate_trace_id()


@contextlib.contextmanager
def preset_ids(trace_id: int | None = None, span_id: int | None = None) -> Iterator[None]:
    token = _PRESET.set((trace_id, span_id))
    try:
        yield
    finally:
        _PRESET.reset(token)


def pick_exporter(signal: str, kind: str, otlp_endpoint: str | None, console: Callable[[], Any]) -> Any:
    """The exporter `exporter_kind` named: OTLP, or the signal's console exporter."""
    if kind == "otlp":
        return otlp_exporter(signal, otlp_endpoint)
    if kind == "console":
        return console()
    raise ValueError(f"OTEL_{signal.upper()}_EXPORTER={kind!r} is not supported (use otlp, console or none)")


class _Provider(Protocol):
    def shutdown(self) -> Any: ...


P = TypeVar("P", bound=_Provider)  # an SDK TracerProvider or MeterProvider


def install_provider(provider: P, set_global: Callable[[P], None], get_global: Callable[[], object],
                     what: str) -> P | None:
    """Make `provider` the process's own; None (and the provider shut down) when another was
    installed first, since the OTel API lets the first one win."""
    set_global(provider)
    if get_global() is not provider:
        log.warning("a %s provider was already installed in this process; tokenpath's is not used", what)
        provider.shutdown()
        return None
    return provider


# The OTLP exporter class of each signal, per protocol package (`{}`: http or grpc).
_OTLP_EXPORTERS = {"traces": ("opentelemetry.exporter.otlp.proto.{}.trace_exporter", "OTLPSpanExporter"),
                   "metrics": ("opentelemetry.exporter.otlp.proto.{}.metric_exporter", "OTLPMetricExporter")}


def otlp_exporter(signal: str, endpoint: str | None) -> Any:
    """The OTLP exporter of one signal ("traces" or "metrics"), honouring the OTEL_* protocol
    variables: http/protobuf by default, grpc when its package is installed. `endpoint` is a base
    URL, as OTEL_EXPORTER_OTLP_ENDPOINT is: the signal's path goes after it."""
    protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    module, name = _OTLP_EXPORTERS[signal]
    if protocol == "grpc":
        try:
            grpc = getattr(importlib.import_module(module.format("grpc")), name)
        except ImportError as exc:
            raise ValueError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                             "install it or use http/protobuf") from exc
        return grpc(endpoint=endpoint) if endpoint else grpc()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (use http/protobuf or grpc)")
    http = getattr(importlib.import_module(module.format("http")), name)
    if endpoint:
        path = f"/v1/{signal}"
        return http(endpoint=endpoint if endpoint.rstrip("/").endswith(path) else endpoint.rstrip("/") + path)
    return http()


def setup_tracing(otlp_endpoint: str | None = None, *, service_name: str = "tokenpath",
                  exporter: SpanExporter | None = None, fixed_name: bool = False) -> TracerProvider | None:
    """Install the process's TracerProvider when tracing is asked for; None when it is off.

    `exporter` is for embedding tokenpath (and tests): any SpanExporter, still batched.
    `fixed_name`: `service_name` wins over OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (engines)."""
    kind = "custom" if exporter is not None else exporter_kind("traces", otlp_endpoint)
    if kind == "none":
        return None
    if exporter is None:
        exporter = pick_exporter("traces", kind, otlp_endpoint, ConsoleSpanExporter)
    # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES; ours is only the default.
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") and not fixed_name else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs), id_generator=PresetIdGenerator())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return install_provider(provider, trace.set_tracer_provider, trace.get_tracer_provider, "tracer")


def tracing_provider() -> TracerProvider | None:
    """The process's SDK provider when tracing is on (spans are worth building), else None."""
    provider = trace.get_tracer_provider()
    return provider if isinstance(provider, TracerProvider) else None


def caller_context(headers: Mapping[str, str]) -> trace.SpanContext | None:
    carrier = {k: headers[k] for k in ("traceparent", "tracestate") if headers.get(k)}
    if not carrier:
        return None
    ctx = trace.get_current_span(PROPAGATOR.extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None


def begin_trace(timeline: Timeline, headers: Mapping[str, str], provider: TracerProvider | None = None) -> None:
    """Choose the request's trace id and its root and dispatch span ids, and the `traceparent`
    a remote replica is sent (`timeline.attrs["traceparent"]`). A valid incoming `traceparent`
    makes the request part of the caller's trace. With tracing off, the caller's own header is
    passed on unchanged, so a traced client still joins up with a traced vLLM behind us."""
    caller = caller_context(headers)
    provider = provider or tracing_provider()
    if provider is None or not isinstance(provider.id_generator, PresetIdGenerator):
        if caller is not None:
            timeline.attrs["trace_id"] = f"{caller.trace_id:032x}"
            timeline.attrs["traceparent"] = headers["traceparent"]
        return
    ids = RandomIdGenerator()
    trace_id = caller.trace_id if caller is not None else ids.generate_trace_id()
    root_id, dispatch_id = ids.generate_span_id(), ids.generate_span_id()
    parent = trace.set_span_in_context(trace.NonRecordingSpan(caller)) if caller is not None else None
    sampled = provider.sampler.should_sample(parent, trace_id, "request").decision.is_sampled()
    timeline.attrs.update(trace_id=f"{trace_id:032x}", trace_root=f"{root_id:016x}",
                          trace_dispatch=f"{dispatch_id:016x}", trace_sampled=sampled,
                          traceparent=f"00-{trace_id:032x}-{dispatch_id:016x}-{'01' if sampled else '00'}")
