"""Process-wide Prometheus series of the middle of the path: queue depth, rejections, routing
decisions, replica ejections and restarts. Admission, routing and replica supervision import
these and count into them; telemetry imports nothing above it.

They live in their own registry, `REGISTRY`, because routing state is process-wide (one gateway,
many deployments) while the API builds one metrics registry per app; `/metrics` appends
`render()` to its own output.

Names follow the `tokenpath:` prefix of the engine's vLLM-compatible series. Labels stay
low-cardinality on purpose: reasons and policies are short fixed words; tenants are bounded by the
key store.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()

QUEUE_DEPTH = Gauge(
    "tokenpath:queue_depth",
    "Requests waiting in the gateway's flow-control queue.",
    ["deployment", "band", "tenant"], registry=REGISTRY,
)
QUEUE_DEPTH_TOTAL = Gauge(
    "tokenpath:gateway_queue_depth",
    "Requests waiting in the gateway's flow-control queue, all bands and tenants (0 from the start).",
    ["deployment"], registry=REGISTRY,
)
REJECTIONS = Counter(
    "tokenpath:admission_rejections",
    "Requests rejected or removed by admission control, by reason.",
    ["deployment", "reason"], registry=REGISTRY,
)
ADMISSIONS = Counter(
    "tokenpath:admissions",
    "Requests admitted, by outcome (immediate or queued).",
    ["deployment", "outcome"], registry=REGISTRY,
)
SHARE_PREEMPTIONS = Counter(
    "tokenpath:share_preemptions",
    "Running requests paused (by recompute, resumed later) so that another tenant's request under "
    "its share of the slots could run (admission/preempt.py).",
    ["deployment"], registry=REGISTRY,
)
ROUTING_DECISIONS = Counter(
    "tokenpath:routing_decisions",
    "Replica routing decisions by policy and outcome (prefix_hit, cold, load_escape, ...).",
    ["deployment", "policy", "outcome"], registry=REGISTRY,
)
QUEUE_TIME = Histogram(
    "tokenpath:gateway_queue_time_seconds",
    "Time from admission to dispatch in the gateway queue.",
    ["deployment"], registry=REGISTRY,
    buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REPLICA_EJECTIONS = Counter(
    "tokenpath:replica_ejections",
    "Replicas ejected after a failure.",
    ["deployment", "replica"], registry=REGISTRY,
)
REPLICA_RESTARTS = Counter(
    "tokenpath:replica_restarts",
    "Engine restarts after an engine process or in-process step loop died.",
    ["deployment", "replica"], registry=REGISTRY,
)
RETRIES = Counter(
    "tokenpath:replica_retries",
    "Requests retried on another replica after failing before their first token.",
    ["deployment"], registry=REGISTRY,
)


def publish_queue_depth(deployment: str, depth: dict[tuple[int, str], int], seen: set[tuple[int, str]]) -> None:
    """Set the gauge for every (band, tenant) now queued, and zero the ones that emptied."""
    QUEUE_DEPTH_TOTAL.labels(deployment).set(sum(depth.values()))
    for band, tenant in seen - set(depth):
        QUEUE_DEPTH.labels(deployment, str(band), tenant).set(0)
    for (band, tenant), n in depth.items():
        QUEUE_DEPTH.labels(deployment, str(band), tenant).set(n)
    seen.clear()
    seen.update(depth)


def render() -> bytes:
    """The exposition text of these series, for `/metrics`."""
    return generate_latest(REGISTRY)


class RoutingMetricsCollector:
    """Registers these series into another registry: `registry.register(RoutingMetricsCollector())`
    (what the app's per-app `/metrics` registry does to include them)."""

    def collect(self):  # noqa: ANN201 - prometheus_client's Collector protocol
        yield from REGISTRY.collect()
