"""Whether OpenTelemetry is on, and under which service name, read from the environment alone.

Apart from `otel.py` so that a process with tracing off (an engine process by default) decides
so without importing the SDK: OpenTelemetry and what it pulls in (OpenSSL among it) are only
imported once an exporter is asked for.
"""

from __future__ import annotations

import os


def exporter_kind(signal: str, otlp_endpoint: str | None) -> str:
    """Which exporter one signal ("traces" or "metrics") asks for: "otlp", "console", another
    name (refused by `pick_exporter`) or "none", from `--otlp-endpoint` and the OTEL_* variables."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return "none"
    if otlp_endpoint:
        return "otlp"
    kind = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
    if kind:
        return kind.split(",")[0].strip()
    if (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")):
        return "otlp"
    return "none"  # off by default, unlike the SDK's own default


def engine_service_name() -> str:
    """The service an engine outside the gateway's process exports as: `tokenpath-engine`, or
    `{OTEL_SERVICE_NAME}-engine` when the gateway's service was renamed. Engine processes and Ray
    actors inherit the gateway's OTEL_* variables; taking OTEL_SERVICE_NAME as it is would merge
    the two services into one."""
    gateway = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    return f"{gateway}-engine" if gateway else "tokenpath-engine"
