"""Deployments from configuration: which models, which replicas (local processes or URLs), which
routing policy and admission limits. One gateway can front several machines this way.

```yaml
deployments:
  - name: smollm2-135m-instruct
    aliases: [gpt-4o-mini]
    policy: prefix_aware          # round_robin | least_loaded | prefix_aware | session_affinity
    replicas:
      - local: 2                  # two `tokenpath engine` processes on this machine
        engine: {num_kv_blocks: 512}  # EngineConfig fields (tokenpath.config), checked at load
        # engine_args: ["--num-kv-blocks", "512"]  (the same as raw `tokenpath engine` flags)
        # engine_command: [numactl, --cpunodebind=0, python, -m, tokenpath.cli, engine]  (optional)
      - url: http://10.0.0.7:8000 # another tokenpath engine, or vLLM / SGLang / llama.cpp
        max_num_seqs: 64
        kv_events: tcp://10.0.0.7:5557  # vLLM's KV-event publisher: the prefix index is its cache
    fallbacks: [backup-model]
    admission: {max_queue: 128, default_deadline_s: {0: 60}}
```

`tokenpath serve --replicas N` is the same thing for the default chat model: N local processes.

`load: at_start` (the default) starts a deployment's replicas with the server. `load: on_demand`
makes it a catalog model (routing.catalog, as `serve --models-dir`): listed in /v1/models as
`unloaded`, with no engine process, Ray actor or URL connection until its first request, which
waits for the load (the `model_load` stage); under `--models-memory`/`--max-loaded-models` and
`--keep-alive` like any catalog model, and `POST /v1/models/{id}/load`/`unload` apply.
A fallback chain may not name an on-demand deployment, nor start from one: a fallback must
be there when the first choice is not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.config import EngineConfig, engine_flag_names, model_argv
from tokenpath.errors import ModelLoadError
from tokenpath.protocol.names import MODEL, name_problem
from tokenpath.replica.base import Replica
from tokenpath.replica.link_client import LinkReplica
from tokenpath.replica.liveness import Liveness, LivenessConfig
from tokenpath.replica.pool import PoolConfig
from tokenpath.replica.processes import EngineProcess, spawn_engines
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig
from tokenpath.routing.catalog import ModelCatalog
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.routing.replicas import DEFAULT_POLICY, POLICIES, PickerOptions
from tokenpath.server.embedding_deployments import embedding_deployments, embedding_process_deployment

Closer = Callable[[], Awaitable[None]]


class ReplicaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None  # a running OpenAI-compatible server (vLLM, SGLang, llama.cpp, a tokenpath serve)
    local: int = Field(0, ge=0)  # or: this many `tokenpath engine` processes started here, on the engine link
    ray: dict[str, Any] | None = None  # or: engine actors on Ray (RayReplicaConfig fields: num_replicas...)
    model: str | None = None  # the name the server knows the model by (default: discovered)
    api_key: str | None = None
    max_num_seqs: int = Field(0, ge=0)
    # A URL replica's KV events (vLLM's `--kv-events-config` ZMQ publisher, e.g. tcp://10.0.0.7:5557,
    # and its replay endpoint): the prefix-aware picker then reads vLLM's real cache, not a guess.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # Local processes' engine settings: EngineConfig fields (validated here: a typo is a config
    # error, not an engine that fails to start), turned into the flags generated from the same
    # fields; `engine_args` are raw `tokenpath engine` flags after them.
    engine: dict[str, Any] = Field(default_factory=dict)
    engine_args: list[str] = Field(default_factory=list)
    # What starts each local process, instead of `python -m tokenpath.cli engine` (a wrapper such as
    # numactl/taskset, another install); the link flags and engine_args are appended to it.
    engine_command: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_kind(self) -> ReplicaSpec:
        if (self.url is not None) + (self.local > 0) + (self.ray is not None) != 1:
            raise ValueError("a replica entry needs exactly one of `url`, `local: N` or `ray: {...}`")
        for name, endpoint in (("kv_events", self.kv_events), ("kv_events_replay", self.kv_events_replay)):
            if endpoint is not None and self.url is None:
                raise ValueError(f"{name} is for `url` replicas (tokenpath's own engines send their KV events "
                                 "on the engine link)")
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://host:5557, got {endpoint!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events (the live feed it catches up to)")
        if self.engine:
            unknown = set(self.engine) - set(engine_flag_names())
            if unknown:
                raise ValueError(f"engine: unknown setting(s) {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(engine_flag_names())}")
            EngineConfig(**self.engine)
        return self

    @property
    def engine_argv(self) -> list[str]:
        """What a local engine process is started with: the `engine` block as flags, then `engine_args`."""
        return engine_flags(EngineConfig(**self.engine)) + self.engine_args


class DeploymentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    task: Literal["chat", "completion", "embedding"] = "chat"
    model: str | None = None  # what local engines load and the tokenizer comes from (default: name)
    aliases: list[str] = Field(default_factory=list)
    fallbacks: list[str] = Field(default_factory=list)
    policy: str = DEFAULT_POLICY
    load_threshold: float | None = None
    max_model_len: int | None = None
    replicas: list[ReplicaSpec] = Field(min_length=1)
    admission: dict[str, Any] = Field(default_factory=dict)  # AdmissionConfig fields
    pool: dict[str, Any] = Field(default_factory=dict)  # PoolConfig fields
    # Issue 38's spelling: start with the server, or on the first request (the module docstring).
    load: Literal["at_start", "on_demand"] = "at_start"

    @model_validator(mode="after")
    def _names(self) -> DeploymentSpec:
        for name in (self.name, *self.aliases):  # what clients send as `model` (`protocol.names`)
            problem = name_problem(name, MODEL)
            if problem is not None:
                raise ValueError(f"{name!r}: {problem}")
        return self

    @model_validator(mode="after")
    def _policy(self) -> DeploymentSpec:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.task == "embedding" and any(not r.local for r in self.replicas):
            raise ValueError("an embedding deployment's replicas are `local: N` engine processes "
                             "(remote and Ray replicas serve chat models only)")
        for cls, values in ((AdmissionConfig, self.admission), (PoolConfig, self.pool)):
            try:
                cls(**values)
            except TypeError as exc:
                raise ValueError(f"{cls.__name__}: {exc}") from None
        return self


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DeploymentSpec]

    @model_validator(mode="after")
    def _fallbacks_are_loaded(self) -> RoutingConfig:
        on_demand = {s.name for s in self.deployments if s.load == "on_demand"}
        for s in self.deployments:
            named = on_demand.intersection(s.fallbacks)
            if s.fallbacks and (s.name in on_demand or named):
                which = s.name if s.name in on_demand else ", ".join(sorted(named))
                raise ValueError(f"deployment {s.name!r}: fallbacks cannot involve {which!r}, loaded on demand "
                                 "(a fallback must be there when the first choice is not): use `load: at_start`")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> RoutingConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})


def load_tokenizer(model: str, chat_template: str | None = None) -> Any:
    """The gateway tokenizes for remote replicas too: same ids, so prefix hashes match the engine's
    (and the same --chat-template as its local engines)."""
    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.tokenizer import Tokenizer

    return Tokenizer(resolve_model_path(model), chat_template)


async def build_deployment(spec: DeploymentSpec, tokenizer: Any = None,
                           log_dir: Path | None = None) -> tuple[Deployment, list[Closer]]:
    """Start a deployment's replicas: local engine processes (linked and supervised) and URLs."""
    if spec.task == "embedding":
        return await embedding_process_deployment(spec.name, spec.model or spec.name,
                                                  sum(r.local for r in spec.replicas), log_dir, spec.policy,
                                                  spec.admission, spec.pool)
    replicas: list[Replica] = []
    closers: list[Closer] = []
    procs: list[EngineProcess] = []
    model = spec.model or spec.name
    try:
        for i, r in enumerate(spec.replicas):
            if r.ray is not None:
                from tokenpath.replica.ray_replica import ray_replicas

                reps, close = await ray_replicas(r.ray, model, spec.name)
                replicas += reps
                closers.append(close)
            elif r.local:
                ps = await spawn_engines(r.local, model, r.engine_argv, log_dir=log_dir,
                                         name_prefix="engine" if i == 0 else f"engine{i}", deployment=spec.name,
                                         max_num_seqs=r.max_num_seqs,  # (0: the engine's own, from its welcome)
                                         command=r.engine_command or None)
                procs += ps
                replicas += [p.replica for p in ps]
            else:
                rep = RemoteReplica(f"{spec.name}-url{i}", RemoteReplicaConfig(
                    url=r.url or "", model=r.model, api_key=r.api_key, max_num_seqs=r.max_num_seqs,
                    kv_events=r.kv_events, kv_events_replay=r.kv_events_replay))
                await rep.start()
                replicas.append(rep)
        engines = [c for r in replicas if isinstance(r, LinkReplica) and (c := r.info.engine) is not None]
        if tokenizer is None:  # the chat template its local engines run with, as they report it
            # (a Ray actor's may name a file on its own node)
            local = [c for p in procs if (c := p.replica.info.engine) is not None]
            template = next((c.chat_template for c in local if c.chat_template), None)
            tokenizer = await asyncio.to_thread(load_tokenizer, model, template)
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        raise
    for replica in replicas:
        if isinstance(replica, RemoteReplica):
            replica.tokenizer = tokenizer
            closers.append(replica.close)
    closers += [p.stop for p in procs]
    max_len = spec.max_model_len or next(
        (m for r in replicas if (m := getattr(r, "max_model_len", None))),
        next((r.info.max_model_len for r in replicas if isinstance(r, LinkReplica)), 2048))
    options = PickerOptions() if spec.load_threshold is None else PickerOptions(load_threshold=spec.load_threshold)
    dep = Deployment(spec.name, spec.task, replicas, tokenizer=tokenizer, max_model_len=max_len,
                     policy=spec.policy, admission=AdmissionConfig(**spec.admission),
                     pool_config=PoolConfig(**spec.pool), picker_options=options)
    dep.processes = procs
    if any(r.local or r.ray is not None for r in spec.replicas):  # (what LoRA adapters are checked against)
        from tokenpath.engine.lora import base_model_config

        dep.model_config = await asyncio.to_thread(base_model_config, model)
        if engines:  # (local processes and Ray actors alike report theirs)
            dep.max_lora_rank = min(c.max_lora_rank for c in engines)
    return dep, closers


async def build_router(config: RoutingConfig, extra: list[Deployment] | None = None,
                       aliases: dict[str, str] | None = None, log_dir: Path | None = None,
                       catalog: ModelCatalog | None = None) -> tuple[ModelRouter, list[Closer]]:
    """Start every `load: at_start` deployment's replicas and wire aliases and fallbacks. `extra`
    are deployments built elsewhere (e.g. the in-process embedding model); `catalog` holds the
    `load: on_demand` ones (server.catalog.on_demand_catalog)."""
    deployments = list(extra or [])
    closers: list[Closer] = []
    try:
        for spec in (s for s in config.deployments if s.load == "at_start"):
            dep, c = await build_deployment(spec, log_dir=log_dir)
            deployments.append(dep)
            closers += c
    except BaseException:
        await asyncio.gather(*(c() for c in closers), return_exceptions=True)
        raise
    all_aliases = dict(aliases or {})
    for spec in config.deployments:
        all_aliases.update({a: spec.name for a in spec.aliases})
    fallbacks = {s.name: s.fallbacks for s in config.deployments if s.fallbacks}
    return ModelRouter(deployments, all_aliases, fallbacks, catalog=catalog), closers


async def replicated_deployment(model: str, n: int, engine_args: list[str] | None = None,
                                policy: str = DEFAULT_POLICY,
                                log_dir: Path | None = None) -> tuple[Deployment, list[Closer]]:
    """`tokenpath serve --replicas N`: N local engine processes of one chat model."""
    spec = DeploymentSpec(name=model, model=model, policy=policy,
                          replicas=[ReplicaSpec(local=n, engine_args=list(engine_args or []))])
    dep, closers = await build_deployment(spec, log_dir=log_dir)
    served = next((r.info.model for r in dep.replicas if isinstance(r, LinkReplica) and r.info.model), model)
    dep.name = served
    for p in dep.processes:
        p.deployment = served
    return dep, closers


async def ray_deployment(model: str, n: int, engine: Any, address: str,
                         policy: str = DEFAULT_POLICY) -> tuple[Deployment, list[Closer]]:
    """`tokenpath serve --ray ADDRESS --replicas N`: N engine actors of one chat model on Ray, with
    the serve command's engine settings. Ray's health reports decide when a restarted actor is
    back, so the pool's own ejection backoff is kept short."""
    prefix = Path(model).name if Path(model).exists() else model
    ray = {"num_replicas": n, "address": address, "name_prefix": prefix,
           "engine": engine.as_dict(exclude_defaults=True, exclude={"model"})}
    spec = DeploymentSpec(name=model, model=model, policy=policy, pool={"eject_max_s": 5.0},
                          replicas=[ReplicaSpec(ray=ray)])
    dep, closers = await build_deployment(spec)
    dep.name = getattr(getattr(dep.replicas[0], "info", None), "model", None) or model
    return dep, closers


def engine_flags(engine: EngineConfig) -> list[str]:
    """An `EngineConfig` as `tokenpath engine` flags, so local processes run with the serve flags."""
    return model_argv(engine, engine_flag_names())


def configure_liveness(router: ModelRouter, config: LivenessConfig) -> None:
    """The serve command's stall and progress bounds on every replica that watches its liveness
    (engine processes, Ray actors, embedding engines, URLs), and the deployment each belongs to."""
    for dep in router.deployments.values():
        for r in dep.replicas:
            liveness = getattr(r, "liveness", None)
            if isinstance(liveness, Liveness):
                liveness.config = config
                liveness.deployment = dep.name


async def serve_router(config: Any, replicas: int = 1, routing_file: str | None = None,
                       policy: str = DEFAULT_POLICY, ray_address: str | None = None,
                       embedding_replicas: int = 1) -> tuple[ModelRouter, list[Closer]]:
    """What `tokenpath serve` needs, in one call (config: `tokenpath.server.config.ServerConfig`):

    - `routing_file`: deployments from YAML (see the module docstring), plus the in-process
      embedding model(s) named in `config.models`;
    - `ray_address`: each chat model in `config.models` as `replicas` engine actors on Ray;
    - `replicas > 1`: each chat model in `config.models` as that many local engine processes;
    - `embedding_replicas > 1`: each embedding model in `config.models` as that many local engine
      processes (else in-process, unless the routing file names it);
    - otherwise: the in-process deployments of `tokenpath.server.deployments.load_deployments`.
    Aliases from `config.aliases` apply in every case.
    """
    from tokenpath.config import resolve_data_dir
    from tokenpath.server.config import is_embedding_model
    from tokenpath.server.deployments import load_deployments

    log_dir = resolve_data_dir(config.data_dir) / "logs" / "engines"

    if routing_file is None and replicas <= 1 and ray_address is None and embedding_replicas <= 1:
        in_process, closers = await load_deployments(config)
        for d in in_process:
            d.policy = policy if d.task != "embedding" else d.policy
        return ModelRouter(in_process, config.aliases), closers
    try:
        routing = RoutingConfig.from_yaml(routing_file) if routing_file is not None else None
    except ValidationError as exc:  # a start-up error naming the file and each bad field, not a traceback
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
        raise ModelLoadError(f"--routing {routing_file}: {problems}") from None
    configured = {s.name for s in routing.deployments} if routing is not None else set()
    embeddings, closers = await embedding_deployments(config.models, embedding_replicas, configured, log_dir)
    if routing is not None:
        from tokenpath.server.catalog import on_demand_catalog

        on_demand = [s for s in routing.deployments if s.load == "on_demand"]
        taken = {s.name for s in routing.deployments if s.load == "at_start"} | {d.name for d in embeddings}
        try:
            catalog = (on_demand_catalog(on_demand, config, log_dir, taken)
                       if on_demand or getattr(config, "models_dir", None) is not None else None)
        except ValueError as exc:  # two models with one name: a start-up error naming both
            await asyncio.gather(*(c() for c in closers), return_exceptions=True)
            raise ModelLoadError(str(exc)) from None
        try:
            router, more = await build_router(routing, extra=embeddings, aliases=config.aliases, log_dir=log_dir,
                                              catalog=catalog)
        except BaseException:
            await asyncio.gather(*(c() for c in closers), return_exceptions=True)
            raise
        configure_liveness(router, config.liveness())
        if catalog is not None:
            catalog.start()
            more.append(catalog.close)
        return router, closers + more
    deployments: list[Deployment] = list(embeddings)
    try:
        for model in (m for m in config.models if not is_embedding_model(m)):
            if ray_address is not None:
                dep, more = await ray_deployment(model, replicas, config.engine, ray_address, policy)
            else:
                dep, more = await replicated_deployment(model, replicas, engine_flags(config.engine), policy,
                                                        log_dir=log_dir)
            deployments.append(dep)
            closers += more
    except BaseException:
        await asyncio.gather(*(c() for c in closers), return_exceptions=True)
        raise
    router = ModelRouter(deployments, config.aliases)
    configure_liveness(router, config.liveness())
    return router, closers
