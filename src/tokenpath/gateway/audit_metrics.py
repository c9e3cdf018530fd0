"""Prometheus series of the audit log's writer, read at scrape time from `RequestGuard.audit_health`:
an operator alerts on `tokenpath:audit_rows_dropped_total` rising or `tokenpath:audit_store_degraded`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenpath.gateway.base import AuditHealth

PREFIX = "tokenpath:"


class AuditCollector(Collector):
    def __init__(self, health: Callable[[], AuditHealth | None]) -> None:
        self._health = health

    def collect(self) -> Iterator[Any]:
        h = self._health()
        if h is None:  # no audit log (OpenGuard)
            return
        yield GaugeMetricFamily(PREFIX + "audit_store_degraded",
                                "1 while audit rows cannot be written to the store (they are spooled).",
                                value=int(h.degraded))
        yield GaugeMetricFamily(PREFIX + "audit_spool_rows", "Audit rows held in memory, waiting for the store.",
                                value=h.spool_rows)
        yield CounterMetricFamily(PREFIX + "audit_rows_spooled", "Audit rows held in memory because the store "
                                  "could not be written.", value=h.spooled_total)
        yield CounterMetricFamily(PREFIX + "audit_rows_dropped", "Audit rows lost because the spool was full.",
                                  value=h.dropped_total)
        yield CounterMetricFamily(PREFIX + "audit_rows_written", "Audit row writes (opens and closes) "
                                  "committed to the store.", value=h.written_total)
