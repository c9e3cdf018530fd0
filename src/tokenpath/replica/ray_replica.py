"""Engine replicas on a Ray cluster (`tokenpath serve --ray auto|ADDRESS --replicas N`, or a
deployment entry `replicas: [{ray: {num_replicas: N, num_cpus: C, resources: {...}}}]`).

Each engine is a named Ray actor (`EngineActor`, in a namespace, `{deployment}-{i}`), placed by
Ray wherever its resources fit; tokenpath never places or restarts processes itself. The gateway
side of each actor is a `RayReplica`, a `Replica` like the others, so the same pickers route over
it (prefix-aware, least-loaded, session) and the same pool ejects and retries:

- Ray restarts a dead actor (`max_restarts`, unlimited by default). While it is down, its state
  says unhealthy and the pool routes around it; when it answers again, it takes traffic again.
- A request on an actor that dies fails with `EngineDeadError` (a 503): the router retries it
  on another replica if no token was sent yet, otherwise ends it with a clean error. A stream
  never waits on a dead actor: Ray fails it, and the health poll cancels streams of an actor it
  has seen die.

Several gateways share one set of actors: the first one creates them, the next ones find them
by name in the namespace and route to them (with `--redis-url`, they share limits too). The
actors are detached, so they outlive the gateway that created them; each gateway holds a lease
on them through its state polls, and the last gateway to shut down stops them (see
`tokenpath.replica.ray_actor`). A gateway that crashed leaves them running for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenpath.config import EngineConfig
from tokenpath.errors import EngineDeadError, TokenpathError
from tokenpath.protocol import GenerateRequest, ReplicaState, RequestOutput
from tokenpath.replica.polled import PolledState
from tokenpath.replica.ray_actor import ActorDelta, ActorState, EngineActor

log = logging.getLogger("tokenpath.replica")

NAMESPACE = "tokenpath"


@dataclass
class RayReplicaConfig:
    """Where and how the engine actors run. `address`: "auto" (the running cluster, or RAY_ADDRESS),
    "host:port" of a head, "ray://host:10001"; None: whatever `ray.init()` does (a local cluster)."""

    num_replicas: int = 1
    address: str | None = "auto"
    namespace: str = NAMESPACE
    name_prefix: str | None = None  # actor names are {prefix}-{i}; default: the deployment's name
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"node:10.0.0.7": 0.01}
    max_restarts: int = -1  # -1: Ray restarts a dead actor as often as it dies
    # Lower CPU priority for the engine, as local engine processes get: a gateway on the same node
    # is light and latency-bound and should get a core first. No effect on a node of its own.
    nice: int = 5
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (model defaults to the deployment's)
    poll_interval_s: float = 0.25
    state_timeout_s: float = 2.0  # a state call slower than this counts as a failed poll
    unhealthy_after: int = 2  # consecutive slow polls before the replica is routed around
    startup_timeout_s: float = 600.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("Ray replicas need Ray: pip install 'tokenpath[ray]'") from exc
    return ray


def connect(address: str | None, namespace: str = NAMESPACE) -> Any:
    """Join the Ray cluster as a driver (once per process)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    return ray


class RayReplica(PolledState):
    def __init__(self, name: str, handle: Any, config: RayReplicaConfig, gateway: str | None = None) -> None:
        self.name = name
        self.handle = handle
        self.config = config
        self.gateway = gateway or uuid.uuid4().hex  # this gateway's lease on the actor
        self.restarts = 0  # restarts this gateway has seen (Ray's own count: `tokenpath status`)
        self.info: ActorState | None = None
        self._state = ReplicaState(name=name, healthy=False, detail="not polled yet")
        self._incarnation: str | None = None
        self._slow_polls = 0
        self._streams: dict[str, tuple[Any, str | None]] = {}  # request id -> (Ray stream, incarnation)
        self._poller: asyncio.Task | None = None
        ray = _ray()
        self._actor_errors = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                              ray.exceptions.TaskCancelledError)
        self._task_error = ray.exceptions.RayTaskError

    # -- state -------------------------------------------------------------------------------------
    async def start(self, timeout_s: float | None = None) -> None:
        """Wait for the actor to be up (its engine loaded), then keep polling its state."""
        deadline = time.monotonic() + (timeout_s or self.config.startup_timeout_s)
        while True:
            try:
                self._set(await asyncio.wait_for(self.handle.state.remote(self.gateway),
                                                 max(1.0, deadline - time.monotonic())))
                break
            except self._task_error as exc:  # the engine failed to load: say why, do not wait
                raise EngineDeadError(f"Ray replica '{self.name}' failed to start: {exc}") from exc
            except (TimeoutError, *self._actor_errors) as exc:
                if getattr(exc, "actor_init_failed", False):  # its constructor raised: Ray will not restart it
                    cause = str(exc).strip().splitlines()[-1][:500]
                    raise EngineDeadError(f"Ray replica '{self.name}' failed to start: {cause}") from exc
                if time.monotonic() >= deadline:
                    raise EngineDeadError(f"Ray replica '{self.name}' not up in time: {exc}") from exc
                await asyncio.sleep(0.5)
        self._ensure_poller()

    async def poll(self) -> ReplicaState:
        try:
            state = await asyncio.wait_for(self.handle.state.remote(self.gateway), self.config.state_timeout_s)
        except TimeoutError:  # busy, restarting, or its node is gone: out of routing after a few
            self._slow_polls += 1
            if self._slow_polls >= self.config.unhealthy_after:
                self._down(f"state not answered within {self.config.state_timeout_s:.1f}s")
        except Exception as exc:  # the actor died (Ray is restarting it) or cannot run tasks
            self._down(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            self._cancel_streams()
        else:
            self._set(state)
        return self._state

    def _set(self, s: ActorState) -> None:
        if self._incarnation is not None and s.incarnation != self._incarnation:
            self.restarts += 1
            self._cancel_streams(s.incarnation)  # their engine is gone; the new one never heard of them
            log.warning("Ray replica %s restarted (pid %d on node %s); routing to it again", self.name, s.pid,
                        s.node_ip)
        elif not self._state.healthy and self._incarnation is not None and s.healthy:
            log.warning("Ray replica %s answers again; routing to it again", self.name)
        self._incarnation = s.incarnation
        self._slow_polls = 0
        self.info = s
        self._state = ReplicaState(name=self.name, waiting=s.waiting, running=s.running, kv_usage=s.kv_usage,
                                   healthy=s.healthy, max_num_seqs=s.max_num_seqs, block_size=s.block_size,
                                   num_blocks=s.num_blocks, detail=None if s.healthy else "engine unhealthy")

    def _down(self, detail: str) -> None:
        if self._state.healthy:
            log.warning("Ray replica %s is down (%s); routing around it", self.name, detail)
        self._state = replace(self._state, healthy=False, detail=detail)

    def _cancel_streams(self, keep: str | None = None) -> None:
        """End the streams of a dead incarnation (all but those dispatched to `keep`)."""
        ray = _ray()
        for gen, incarnation in list(self._streams.values()):
            if keep is None or incarnation != keep:
                with contextlib.suppress(Exception):
                    ray.cancel(gen)

    @property
    def max_model_len(self) -> int | None:
        return self.info.max_model_len if self.info else None

    async def close(self) -> None:
        await self._stop_polling()

    async def release(self) -> int | None:
        """Give up this gateway's lease: how many other gateways still route to the actor (None:
        it did not answer, so nobody can say)."""
        try:
            return int(await asyncio.wait_for(self.handle.release.remote(self.gateway), self.config.state_timeout_s))
        except Exception:  # noqa: BLE001 - dead, restarting or gone: the caller decides without it
            return None

    async def reset_prefix_cache(self) -> int:
        """Forget the actor's prefix cache (POST /reset_prefix_cache reaches every replica)."""
        try:
            return int(await asyncio.wait_for(self.handle.reset_prefix_cache.remote(), self.config.state_timeout_s))
        except (TimeoutError, *self._actor_errors) as exc:
            raise EngineDeadError(f"Ray replica '{self.name}' did not reset its prefix cache: "
                                  f"{type(exc).__name__}") from exc

    # -- the engine link -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self._state.healthy:
            raise EngineDeadError(f"Ray replica '{self.name}' is down: {self._state.detail}")
        # The Timeline stays here (the replica boundary stamps the engine's events on it); a
        # deadline is this process's clock, so it stays here too.
        shipped = replace(request, timeline=None, deadline=None)
        ray = _ray()
        gen = self.handle.generate.options(num_returns="streaming").remote(shipped)
        self._streams[request.request_id] = (gen, self._incarnation)
        finished = False
        try:
            async for ref in gen:
                delta: ActorDelta = await ref
                shift = time.monotonic() - delta.sent_at  # actor clock -> this process's clock
                delta.output.events = delta.output.events.shifted(shift)
                finished = delta.output.finished
                yield delta.output
        except self._task_error as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, TokenpathError):
                raise cause from None  # the engine's own verdict on the request (e.g. a 400)
            raise EngineDeadError(f"Ray replica '{self.name}' failed: {cause or exc}") from exc
        except self._actor_errors as exc:
            self._down(f"{type(exc).__name__} during a request")
            raise EngineDeadError(f"Ray replica '{self.name}' died during the request "
                                  f"({type(exc).__name__}); Ray is restarting it") from exc
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                with contextlib.suppress(Exception):
                    ray.cancel(gen)  # raises CancelledError in the actor's stream, which aborts it

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(Exception):
                _ray().cancel(stream[0])
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.handle.abort.remote(request_id), self.config.state_timeout_s)


async def start_ray_replicas(config: RayReplicaConfig, model: str,
                             engine: EngineConfig | None = None) -> tuple[list[RayReplica], list[Any]]:
    """Create the deployment's engine actors, or find them by name when another gateway already
    did, and wait until each one answers. Returns the replicas and the handles of the actors this
    call created (stopped again if the start fails)."""
    ray = connect(config.address, config.namespace)
    engine = engine or EngineConfig(**{"model": model, **config.engine})
    actor_cls = ray.remote(EngineActor)
    prefix = config.name_prefix or model.replace("/", "_")
    existing = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == config.namespace}
    gateway = uuid.uuid4().hex
    replicas: list[RayReplica] = []
    created: list[Any] = []
    for i in range(config.num_replicas):
        name = f"{prefix}-{i}"
        if name in existing:  # another gateway's: same actor, same engine (its options are the creator's)
            log.info("Ray replica %s exists in namespace %r: routing to it", name, config.namespace)
        # get_if_exists: two gateways starting at once still end up with one actor per name.
        handle = actor_cls.options(
            name=name, namespace=config.namespace, get_if_exists=True, lifetime="detached",
            max_restarts=config.max_restarts, max_task_retries=0, num_cpus=config.num_cpus,
            num_gpus=config.num_gpus, resources=dict(config.resources) or None, max_concurrency=1000,
        ).remote(engine, config.nice)
        if name not in existing:
            created.append(handle)
        replicas.append(RayReplica(name, handle, config, gateway))
    try:
        await asyncio.gather(*(r.start() for r in replicas))
    except BaseException:
        await stop_ray_replicas(replicas, created)
        raise
    return replicas, created


async def stop_ray_replicas(replicas: list[RayReplica], created: list[Any]) -> None:
    """Leave the actors; stop those no other gateway routes to any more (and those this gateway
    created but never saw answer)."""
    ray = _ray()
    for r in replicas:
        await r.close()
    others = await asyncio.gather(*(r.release() for r in replicas))
    for r, n in zip(replicas, others, strict=True):
        if n == 0 or (n is None and any(h is r.handle for h in created)):
            with contextlib.suppress(Exception):
                ray.kill(r.handle, no_restart=True)
        elif n:
            log.info("Ray replica %s stays up: %d other gateway(s) route to it", r.name, n)


async def ray_replicas(spec: dict[str, Any], model: str, deployment: str,
                       engine: EngineConfig | None = None) -> tuple[list[RayReplica], Callable[[], Awaitable[None]]]:
    """A deployment entry's `ray: {...}` (RayReplicaConfig fields) -> its replicas and their closer."""
    try:
        config = RayReplicaConfig(**{"name_prefix": deployment, **spec})
    except TypeError as exc:
        raise ValueError(f"ray replicas of {deployment!r}: {exc}") from None
    replicas, created = await start_ray_replicas(config, model, engine)
    return replicas, lambda: stop_ray_replicas(replicas, created)
