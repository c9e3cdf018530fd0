"""The in-process replica: an `AsyncEngine` in this process behind the `Replica` interface.

It shares the gateway's clock, so the engine's event times are passed on as they are. If the
engine's step loop dies, the replica reports itself unhealthy at once (so the pool ejects it and
`/health` says why) and rebuilds the engine in the background with exponential backoff; once the
new engine runs, state says healthy and the pool re-admits it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, ReplicaState, RequestOutput
from tokenpath.telemetry import series

log = logging.getLogger("tokenpath.replica")

RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0


class InProcessReplica:
    def __init__(self, engine: AsyncEngine, name: str | None = None, deployment: str | None = None) -> None:
        self.engine = engine
        self.name = name or f"local:{engine.model_name}"
        self.deployment = deployment or engine.model_name
        self.restarts = 0
        self._restarting: asyncio.Task | None = None
        self._closed = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def step_stats(self) -> dict[str, list]:
        """The engine's cumulative step histograms (`telemetry.engine_steps`)."""
        return self.engine.step_stats.snapshot()

    def state(self) -> ReplicaState:
        s = self.engine.state()
        if not s.healthy:
            self._supervise()
        detail = None
        if not s.healthy:
            detail = f"engine step loop died: {self.engine.error!r}; restarting" if self.engine.error else "starting"
        return ReplicaState(
            name=self.name,
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            healthy=s.healthy,
            prefix_hashes=self.engine.core.blocks.cached_hashes(),
            max_num_seqs=self.engine.config.max_num_seqs,
            block_size=s.block_size,
            num_blocks=s.num_blocks,
            detail=detail,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            restarts=self.restarts,
            loras=frozenset(s.loras),
            running_loras=s.running_loras,
            waiting_loras=s.waiting_loras,
            max_loras=s.max_loras,
        )

    def _supervise(self) -> None:
        if self._closed or self.engine.error is None or (self._restarting and not self._restarting.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._restarting = loop.create_task(self._restart())

    async def _restart(self) -> None:
        log.warning("replica %s: engine step loop died (%r); restarting it", self.name, self.engine.error)
        delay = RESTART_BASE_S
        while not self._closed:
            old = self.engine
            try:
                await old.shutdown()
                engine = await asyncio.to_thread(AsyncEngine, old.config)
                await engine.start()
            except Exception:
                log.exception("replica %s: restart failed; next try in %.0fs", self.name, delay)
                await asyncio.sleep(delay)
                delay = min(RESTART_MAX_S, delay * 2)
                continue
            self.engine = engine
            self.restarts += 1
            series.REPLICA_RESTARTS.labels(self.deployment, self.name).inc()
            log.info("replica %s: engine restarted (restart %d); healthy again", self.name, self.restarts)
            return

    async def close(self) -> None:
        self._closed = True
        if self._restarting is not None:
            self._restarting.cancel()
        await self.engine.shutdown()
