"""The engine as a Ray actor: one `AsyncEngine` per actor, served over the engine link.

Ray places the actor, restarts it when its process dies (`max_restarts`, which gives it a new
`incarnation`) and lets gateways find it by name. Requests do not travel as Ray calls: the actor
serves the same engine link as a local engine process (`link_server.LinkServer`: `GenerateRequest`
frames in, `RequestOutput` deltas with event times out, abort and state on the same socket), on
its node's IP and a port of the kernel's choosing. A Ray streaming call per request cost about
8 ms of ITL and 11% of throughput at c=8 on 2 cores (one Ray object per token, through the raylet;
benchmarks/results/ray_replica.md, git history); the link costs what it costs a local engine.

The gateway asks `link()` for the address and the secret. The secret is new with each
incarnation and only ever crosses Ray (whose cluster token guards it), never a command line or a
log; the link refuses a connection without it, as for local engines.

Ray methods left: `link`, `state` (which also renews a gateway's lease), `release` and nothing per
request. Several gateways may route to the same actors (they find them by name); each one's state
polls renew its lease here (`state(gateway=...)`), and a gateway that shuts down `release`s it: the
last one out stops the actor, while a gateway that crashed stops renewing and counts no more after
`LEASE_S`. The lease is for that decision only; it never refuses a request.

Clocks: as over any engine link, the gateway measures the offset to this process's monotonic
clock at connect (NTP-style pings, `link_client`), so engine event times on another node land on
the gateway's clock without any clock synchronisation between the machines.

This module imports neither Ray nor anything above the replica layer at import time: Ray wraps the
class at run time (`ray.remote(EngineActor)`), so importing tokenpath never needs the `ray` extra.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tokenpath.config import EngineConfig
from tokenpath.telemetry.engine_spans import setup_engine_tracing

log = logging.getLogger("tokenpath.engine.link")

LEASE_S = 30.0  # a gateway that has not polled for this long no longer keeps the actor alive


@dataclass
class LinkAddress:
    """Where this incarnation's engine link listens, and the secret it asks for."""

    host: str
    port: int
    secret: str
    incarnation: str


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
    served: int  # requests this incarnation has taken on (over its engine link)
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
        self.started_at = time.time()
        self.gateways: dict[str, float] = {}  # gateway id -> monotonic time of its last state poll
        self.secret = secrets.token_urlsafe(32)
        self._link: LinkAddress | None = None
        self._server: Any = None  # the LinkServer, once started
        self._starting = asyncio.Lock()  # `state` and `link` may both arrive first

    async def _started(self) -> None:
        async with self._starting:
            if self._server is None:
                await self._start()

    async def _start(self) -> None:
        """Start the engine (its step thread needs this actor's running loop) and its link."""
        import ray

        from tokenpath.replica.link_server import LinkServer

        _set_niceness(self.nice)
        # The gateway passes its OTEL_* settings in the actor's runtime environment (ray_replica).
        provider = setup_engine_tracing(self.engine.core.step_observers)
        await self.engine.start()
        host = ray.util.get_node_ip_address()
        sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128)
        server = LinkServer(self.engine, self.secret, tracer_provider=provider)
        await server.start(sock)
        self._link = LinkAddress(host, sock.getsockname()[1], self.secret, self.incarnation)
        self._server = server
        log.info("engine actor %s: engine link on %s:%d", self.incarnation[:8], host, self._link.port)

    async def link(self) -> LinkAddress:
        """Where this incarnation's engine link listens (starting the engine on first call)."""
        await self._started()
        assert self._link is not None
        return self._link

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
            served=self._server.served, started_at=self.started_at, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, gateways=self._live_gateways(),
        )


def _set_niceness(nice: int) -> None:
    """Run the engine at nice `nice`, as a local engine process runs (`tokenpath.replica.processes`).

    Ray starts its workers at nice 15 (the raylet's `RAY_worker_niceness`), so an engine actor left
    as it is gets a tenth of a core's share next to a nice-0 process; measured on 2 busy cores it
    added ~10 ms ITL at c=8 against a local engine process at nice 5. Niceness is per thread on
    Linux and inherited by the threads a thread creates: set on this (the loop's) thread before the
    engine starts, it covers the step thread and its kernel threads. Lowering a nice value needs
    CAP_SYS_NICE; without it the engine stays where Ray put it, and the log says how to change that.
    """
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if current == nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        log.warning("engine actor: runs at Ray's worker nice %d, not %d (no permission to change it); start "
                    "Ray with RAY_worker_niceness=%d for the CPU share of a local engine", current, nice, nice)
