"""Who may ask, and how much: API keys, tenants, model access, rate limits, quotas, audit log."""

from __future__ import annotations

from pathlib import Path

from tokenpath.gateway.base import AuditRecord, OpenGuard, Principal, RequestGuard, Reservation

__all__ = ["AuditRecord", "OpenGuard", "Principal", "RequestGuard", "Reservation", "open_gateway"]


def open_gateway(data_dir: Path, database_url: str | None = None, **options: object) -> RequestGuard:
    """The guard `tokenpath serve` puts in front of its routes (replaced by the real gateway)."""
    return OpenGuard()
