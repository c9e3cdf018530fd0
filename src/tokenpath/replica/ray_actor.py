"""The engine as a Ray actor: one `AsyncEngine` per actor, speaking the engine link in typed objects.

The gateway (`tokenpath.replica.ray_replica.RayReplica`) calls `generate` (a streaming method: a
`GenerateRequest` in, `ActorDelta`s out), `abort`, `state` and `reset_prefix_cache`. Ray carries
them; Ray restarts the actor when its process dies (`max_restarts`), which gives it a new
`incarnation` (that is how the gateway counts restarts and knows the engine behind a name is a
fresh one with an empty cache).

Several gateways may route to the same actors (they find them by name). Each one's state polls
renew its lease here (`state(gateway=...)`), and a gateway that shuts down `release`s it: the
last one out stops the actor, while a gateway that crashed stops renewing and counts no more after
`LEASE_S`. The lease is for that decision only; it never refuses a request.

Clocks: the engine records its events (`RequestOutput.events`: queued, scheduled, first token,
finished) with this process's monotonic clock, which means nothing on another node. Each delta
carries the actor's clock reading at the moment it was sent, and the gateway shifts the times by
(its own clock on receipt - that reading): no clock synchronisation needed, and an event can only
appear later than it was, by the one-way transfer time of that delta.

This module imports neither Ray nor anything above the replica layer: Ray wraps the class at run
time (`ray.remote(EngineActor)`), so importing tokenpath never needs the optional `ray` extra.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from tokenpath.config import EngineConfig
from tokenpath.protocol import GenerateRequest, RequestOutput

LEASE_S = 30.0  # a gateway that has not polled for this long no longer keeps the actor alive


@dataclass
class ActorDelta:
    """One step's output for one request (its events in the actor's clock)."""

    output: RequestOutput
    sent_at: float  # the actor's time.monotonic() when this delta left it


@dataclass
class ActorState:
    """What routing, admission and `tokenpath status` read about one engine actor."""

    model: str
    max_model_len: int
    waiting: int
    running: int
    kv_usage: float
    num_blocks: int
    block_size: int
    max_num_seqs: int
    healthy: bool
    node_id: str
    node_ip: str
    pid: int
    incarnation: str  # new on every (re)start of the actor
    served: int  # requests this incarnation has been given
    started_at: float  # wall clock of this incarnation's start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (this incarnation)
    prefix_cache_hits: int = 0
    gateways: int = 0  # gateways whose lease is live (they route to this actor)


class EngineActor:
    """Wrapped by `ray.remote` at run time; its methods run on the actor's event loop."""

    def __init__(self, config: EngineConfig, nice: int = 0) -> None:
        from tokenpath.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(config)
        self.config = config
        self.nice = nice
        self.incarnation = uuid.uuid4().hex
        self.served = 0
        self.started_at = time.time()
        self.gateways: dict[str, float] = {}  # gateway id -> monotonic time of its last state poll

    async def _started(self) -> None:
        if self.engine._thread is None:  # the step thread needs this actor's running loop
            if self.nice:
                # Niceness is per thread on Linux and inherited by the threads a thread creates: set
                # here, it covers this loop, the step thread and its OpenMP pool, as for an engine
                # process (see tokenpath.replica.processes). Best effort: a container may forbid it.
                with contextlib.suppress(OSError):
                    tid = threading.get_native_id()
                    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
            await self.engine.start()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[ActorDelta]:
        """Stream deltas. Ray's cancellation of this stream (the gateway closing it) raises
        CancelledError here, and closing the engine's stream aborts the request there."""
        await self._started()
        self.served += 1
        async for out in self.engine.generate(replace(request, arrival=time.monotonic())):
            yield ActorDelta(out, time.monotonic())

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's prefix cache (POST /reset_prefix_cache), as over the engine link."""
        return self.engine.reset_prefix_cache()

    async def release(self, gateway: str) -> int:
        """A gateway leaves; returns how many others still hold a live lease."""
        self.gateways.pop(gateway, None)
        return self._live_gateways()

    def _live_gateways(self) -> int:
        now = time.monotonic()
        return sum(1 for seen in self.gateways.values() if now - seen < LEASE_S)

    async def state(self, gateway: str | None = None) -> ActorState:
        """The engine's state; a gateway's poll (`gateway` set) also renews its lease."""
        if gateway is not None:
            self.gateways[gateway] = time.monotonic()
        await self._started()
        import ray

        s = self.engine.state()
        ctx = ray.get_runtime_context()
        return ActorState(
            model=self.engine.model_name, max_model_len=self.engine.max_model_len, waiting=s.waiting,
            running=s.running, kv_usage=s.kv_usage, num_blocks=s.num_blocks, block_size=s.block_size,
            max_num_seqs=self.config.max_num_seqs, healthy=s.healthy, node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(), pid=os.getpid(), incarnation=self.incarnation,
            served=self.served, started_at=self.started_at, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            gateways=self._live_gateways(),
        )
