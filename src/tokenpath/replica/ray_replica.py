"""Engine replicas on a Ray cluster (`tokenpath serve --ray auto|ADDRESS --replicas N`, or a
deployment entry `replicas: [{ray: {num_replicas: N, num_cpus: C, resources: {...}}}]`).

Each engine is a named Ray actor (`EngineActor`, in a namespace, `{deployment}-{i}`), placed by
Ray wherever its resources fit; tokenpath never places or restarts processes itself. The gateway
side of each actor is a `RayReplica`: an engine-link replica like a local engine process's (the
actor serves the same link, see `ray_actor`), so requests carry token ids and event times with no
Ray call per request or token, the same pickers route over it (prefix-aware, least-loaded,
session), and the same pool ejects and retries. Ray is the control plane only:

- Ray restarts a dead actor (`max_restarts`, unlimited by default). Its link closes when its
  process dies, so it is routed around at once; a poll of the actor every `poll_interval_s` links
  to the new incarnation as soon as it answers, and it takes traffic again.
- A request on an actor that dies fails with `EngineDeadError` (a 503) the moment its link
  closes: the router retries it on another replica if no token was sent yet, otherwise ends it
  with a clean error. A hung actor or a lost node (no close) is routed around after the link's
  `STALE_AFTER_S` without a state push.

Several gateways share one set of actors: the first one creates them, the next ones find them
by name in the namespace and route to them (with `--redis-url`, they share limits too). The
actors are detached, so they outlive the gateway that created them; each gateway holds a lease
on them through its state polls, and the last gateway to shut down stops them (see
`tokenpath.replica.ray_actor`). A gateway that crashed leaves them running for the next one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenpath.config import EngineConfig
from tokenpath.errors import EngineDeadError
from tokenpath.replica.link_client import EngineLinkReplica
from tokenpath.replica.ray_actor import ActorState, EngineActor, LinkAddress

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
    # The engine's nice value, as local engine processes get (not Ray's worker default of 15): a
    # gateway on the same node is light and latency-bound and should get a core first, but Ray's
    # own daemons should not. No effect on a node of its own.
    nice: int = 5
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (model defaults to the deployment's)
    poll_interval_s: float = 0.5  # lease renewal and relinking after a restart (load comes over the link)
    state_timeout_s: float = 2.0  # how long one Ray call (state, link, release) may take
    startup_timeout_s: float = 600.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("Ray replicas need Ray: pip install 'tokenpath[ray]'") from exc
    return ray


def _stop_private_head(ray: Any, temp_dir: str) -> None:
    """Stop the head `--ray local` started (its processes first: they write into the dir), then
    remove its temp dir."""
    with contextlib.suppress(Exception):
        ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def connect(address: str | None, namespace: str = NAMESPACE) -> Any:
    """Join the Ray cluster as a driver (once per process).

    `auto` attaches to a running cluster (RAY_ADDRESS or this machine's) and says in one line how
    to start one when there is none; `local` starts a private head on loopback for this process
    alone, in its own temp dir, which Ray stops when the process exits (and the dir goes with it).
    """
    ray = _ray()
    if ray.is_initialized():
        return ray
    opts: dict[str, Any] = {}
    if address == "local":
        temp_dir = tempfile.mkdtemp(prefix="tpray")  # short: Ray's socket paths must fit
        atexit.register(_stop_private_head, ray, temp_dir)
        opts = {"_temp_dir": temp_dir, "_node_ip_address": "127.0.0.1", "include_dashboard": False}
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False, **opts)
    except ConnectionError as exc:
        if address != "auto":
            raise EngineDeadError(f"--ray {address}: cannot reach that Ray cluster ({exc})") from None
        raise EngineDeadError(
            "--ray auto: no Ray cluster is running here and RAY_ADDRESS is unset. Start one "
            "(`ray start --head --node-ip-address 127.0.0.1`) and pass its address, or use --ray local "
            "for a private one that lives and dies with this server") from None
    return ray


class RayReplica(EngineLinkReplica):
    """One engine actor: requests over its engine link (inherited: generate, abort, state pushes,
    reset_prefix_cache), its life over Ray (finding it, its lease, noticing a restart)."""

    def __init__(self, name: str, handle: Any, config: RayReplicaConfig, gateway: str | None = None) -> None:
        super().__init__(name, secret="")  # the secret comes from the actor (`link()`)
        self.handle = handle
        self.config = config
        self.gateway = gateway or uuid.uuid4().hex  # this gateway's lease on the actor
        self.actor: ActorState | None = None  # the actor's last answer to a state poll
        self._incarnation: str | None = None  # the engine our link was made to
        self._poller: asyncio.Task | None = None
        ray = _ray()
        self._actor_errors = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                              ray.exceptions.TaskCancelledError)
        self._task_error = ray.exceptions.RayTaskError

    async def start(self, timeout_s: float | None = None) -> None:
        """Wait for the actor to be up (its engine loaded), link to it, then keep polling it."""
        deadline = time.monotonic() + (timeout_s or self.config.startup_timeout_s)
        while True:
            try:
                address = await asyncio.wait_for(self.handle.link.remote(), max(1.0, deadline - time.monotonic()))
                break
            except self._task_error as exc:  # the engine failed to load: say why, do not wait
                raise EngineDeadError(f"Ray replica '{self.name}' failed to start: {_cause(exc)}") from exc
            except (TimeoutError, *self._actor_errors) as exc:
                if getattr(exc, "actor_init_failed", False):  # its constructor raised: Ray will not restart it
                    raise EngineDeadError(f"Ray replica '{self.name}' failed to start: {_cause(exc)}") from exc
                if time.monotonic() >= deadline:
                    raise EngineDeadError(f"Ray replica '{self.name}' not up in time: {exc}") from exc
                await asyncio.sleep(0.5)
        await self._link_to(address)
        await self.poll()  # its lease, and its node for the log
        self._poller = asyncio.create_task(self._poll_loop())

    async def _link_to(self, address: LinkAddress) -> None:
        self.secret = address.secret
        await self.connect(address.host, address.port)
        if self._incarnation is not None and address.incarnation != self._incarnation:
            self.restarts += 1
            log.warning("Ray replica %s restarted (engine link %s:%d); routing to it again", self.name,
                        address.host, address.port, extra={"event": "replica_restarted", "replica": self.name})
        elif self._incarnation is not None:
            log.warning("Ray replica %s answers again; routing to it again", self.name,
                        extra={"event": "replica_healthy", "replica": self.name})
        self._incarnation = address.incarnation

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            await self.poll()

    async def poll(self) -> None:
        """Renew the lease; when the link is down (the actor died and Ray restarted it, or it was
        unreachable), link again as soon as the actor answers."""
        try:
            s: ActorState = await asyncio.wait_for(self.handle.state.remote(self.gateway),
                                                   self.config.state_timeout_s)
        except TimeoutError:  # busy or restarting; the link's own health (state pushes) decides routing
            return
        except Exception as exc:  # the actor died (Ray is restarting it) or cannot run tasks
            self.mark_down(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return
        self.actor = s
        if s.incarnation != self._incarnation and self._writer is not None:
            self.mark_down("the actor was restarted")  # (its link would have closed; never keep a stale one)
        if self._writer is None:
            try:
                await self._link_to(await asyncio.wait_for(self.handle.link.remote(), self.config.state_timeout_s))
            except Exception as exc:  # noqa: BLE001 - not yet: the next poll tries again
                log.info("Ray replica %s: not linked yet: %s", self.name, exc)

    def mark_down(self, reason: str) -> None:
        if self._down_reason is None:
            log.warning("Ray replica %s is down (%s); routing around it", self.name, reason,
                        extra={"event": "replica_down", "replica": self.name})
        super().mark_down(reason)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(BaseException):
                await self._poller
        await super().close()

    async def release(self) -> int | None:
        """Give up this gateway's lease: how many other gateways still route to the actor (None:
        it did not answer, so nobody can say)."""
        try:
            return int(await asyncio.wait_for(self.handle.release.remote(self.gateway), self.config.state_timeout_s))
        except Exception:  # noqa: BLE001 - dead, restarting or gone: the caller decides without it
            return None


def _tracing_env() -> dict[str, Any] | None:
    """The gateway's OTEL_* settings (its `--otlp-endpoint` among them) for the actors, so their
    engine spans join the gateway's traces, as a local engine process's do. None: nothing to pass
    (and no runtime environment for Ray to set up)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    return {"env_vars": env} if env else None


def _cause(exc: BaseException) -> str:
    """The last line of a Ray error (its cause), not the whole remote traceback."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:500]


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
            runtime_env=_tracing_env(),
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
