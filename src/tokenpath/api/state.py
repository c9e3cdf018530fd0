"""What the routes share: router, guard, settings, metrics, and the in-flight generations (so a
shutdown past its grace period can abort them with finish_reason `abort`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request

from tokenpath.api.grammar_worker import GrammarWorkers
from tokenpath.api.settings import ApiSettings
from tokenpath.api.sse import StopSignal
from tokenpath.gateway.base import RequestGuard
from tokenpath.routing.models import ModelRouter
from tokenpath.telemetry.engine_window import EngineHistory
from tokenpath.telemetry.live import LiveRequests
from tokenpath.telemetry.metrics import ServerMetrics

log = logging.getLogger("tokenpath.api")


@dataclass
class AppState:
    router: ModelRouter
    guard: RequestGuard
    config: ApiSettings
    metrics: ServerMetrics
    inflight: dict[str, StopSignal] = field(default_factory=dict)
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    started: int = field(default_factory=lambda: int(time.time()))
    live: LiveRequests = field(default_factory=LiveRequests)  # what the dashboard shows
    engine_history: EngineHistory = field(default_factory=EngineHistory)  # /diagnose's engine figures
    grammar_workers: GrammarWorkers = field(default_factory=GrammarWorkers)  # schema checks, compiles

    def abort_all(self, reason: str = "shutdown") -> int:
        """Stop every in-flight generation; each one ends with finish_reason `abort`."""
        for stop in list(self.inflight.values()):
            stop.set(reason)
        return len(self.inflight)

    def deployments(self) -> list:
        return list(self.router.deployments.values())

    async def close(self) -> None:
        for fn in [*self.on_shutdown, self.grammar_workers.close]:
            try:
                await fn()
            except Exception:
                log.exception("error while shutting down")


async def get_state(request: Request) -> AppState:
    """The app's state, as a FastAPI dependency. A coroutine so that FastAPI calls it on the event
    loop: a plain `def` dependency runs in its thread pool, a thread hop (0.15-0.5 ms on two busy
    cores) in front of every request."""
    return request.app.state.tokenpath
