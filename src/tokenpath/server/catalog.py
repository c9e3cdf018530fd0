"""`serve --models-dir DIR`: the catalog of models served on demand, and how each is loaded.

Entries (`catalog_entries`): the packaged models (`smollm2-135m-instruct`, `gemma-3-270m`,
`all-minilm-l6-v2`), every `*.gguf` file in DIR (its id: the file's stem) and every directory in
DIR holding a `config.json` (its id: the directory's name; an embedding model when it holds a
`sentence_bert_config.json`), and any `--model` path (pinned: loaded at start, never unloaded). A
sidecar (`<stem>.json` beside a GGUF file, `tokenpath.json` in a directory) may set
`served_model_name` and `pinned`. Two entries with one id stop the start; a file that is not a
model (no GGUF magic, an unreadable config.json, no weights) is an entry in state `failed` with
its reason, and the others serve. Nothing outside the catalog is ever loaded by a request.

The loader (`make_loader`) builds a model's deployment as `serve` would have at start-up: an
in-process engine, or with `--replicas N` / `--embedding-replicas N` that many engine processes
(their processes exist only while the model is loaded). Its footprint is measured after the load:
this process's RSS growth (in-process) or the engine processes' RSS, and never less than the
weights' size on disk plus, for a chat model, its KV cache budget (allocated, not yet touched).
Unloading stops the engines and returns the freed heap to the OS.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpath.config import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL, parse_bytes, parse_duration
from tokenpath.protocol.names import MODEL, name_problem
from tokenpath.routing.catalog import CatalogConfig, CatalogEntry, Loaded, Loader, ModelCatalog
from tokenpath.routing.models import Deployment, Task
from tokenpath.server.config import ServerConfig, is_embedding_model
from tokenpath.server.memory import rss_mib, trim_heap

if TYPE_CHECKING:
    from tokenpath.server.routing_config import DeploymentSpec

log = logging.getLogger("tokenpath.api")

PACKAGED: dict[str, Task] = {DEFAULT_CHAT_MODEL: "chat", "gemma-3-270m": "chat", DEFAULT_EMBEDDING_MODEL: "embedding"}
MIB = 1024 * 1024
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def catalog_entries(models_dir: str | Path | None, pinned: list[str]) -> list[CatalogEntry]:
    """The packaged models, DIR's models and the `pinned` ones (`--model`), in that order; two
    with one id are a ValueError naming both (`ModelCatalog` checks)."""
    entries: list[CatalogEntry] = []
    pinned_names = set(pinned)
    for name, task in PACKAGED.items():
        entries.append(CatalogEntry(name, name, task, size_hint=_packaged_size(name), pinned=name in pinned_names))
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise ValueError(f"--models-dir {models_dir}: no such directory")
        for path in sorted(root.iterdir()):
            entry = _scan(path)
            if entry is not None:
                entries.append(entry)
    for name in pinned:
        if name in PACKAGED:
            continue
        path = Path(name).expanduser().resolve()
        found = next((i for i, e in enumerate(entries) if Path(e.source) == path), None)
        if found is not None:
            e = entries[found]
            entries[found] = CatalogEntry(e.id, e.source, e.task, e.size_hint, True, e.problem)
            continue
        entry = _scan(path)
        if entry is None:
            raise ValueError(f"--model {name}: not a GGUF file, a model directory or a packaged model")
        entries.append(CatalogEntry(entry.id, entry.source, entry.task, entry.size_hint, True, entry.problem))
    return entries


def _packaged_size(name: str) -> int:
    """Bytes on disk of a packaged model whose path is free to find (gemma's is assembled on first use: 0)."""
    if name == "gemma-3-270m":
        return 0
    from tokenpath.engine.loader import resolve_model_path

    try:
        return _disk_size(resolve_model_path(name))
    except Exception:  # a missing package: its load says why
        return 0


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for pattern in _WEIGHTS for p in path.glob(pattern) if p.is_file())


def _scan(path: Path) -> CatalogEntry | None:
    """One directory entry as a catalog entry: a GGUF file, a model directory, or None (anything else)."""
    if path.is_file() and path.suffix == ".gguf":
        sidecar, problem = path.with_suffix(".json"), None
        try:
            with path.open("rb") as f:
                if f.read(4) != b"GGUF":
                    problem = f"{path.name} is not a GGUF file (no GGUF magic at its start)"
        except OSError as exc:
            problem = f"{path.name} cannot be read: {exc}"
        task: Task = "chat"
    elif path.is_dir() and (path / "config.json").is_file():
        sidecar, problem = path / "tokenpath.json", None
        try:
            json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            problem = f"{path.name}/config.json is not a model configuration: {exc}"
        if problem is None and not any(path.glob(p) for p in _WEIGHTS):
            problem = f"{path.name} holds no weights (*.safetensors, *.bin)"
        task = "embedding" if is_embedding_model(str(path)) else "chat"
    else:
        return None
    served, pinned = path.stem if path.is_file() else path.name, False
    if sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
            served = str(meta.get("served_model_name") or served)
            pinned = bool(meta.get("pinned", False))
        except (OSError, ValueError, AttributeError) as exc:
            problem = problem or f"{sidecar.name}: not a JSON object ({exc})"
    bad = name_problem(served, MODEL)
    if bad is not None:
        raise ValueError(f"--models-dir: {path.name}: its id {served!r} cannot be a model name: {bad}")
    return CatalogEntry(served, str(path.resolve()), task, size_hint=_disk_size(path), pinned=pinned,
                        problem=problem)


def catalog_config(config: ServerConfig) -> CatalogConfig:
    return CatalogConfig(memory_bytes=parse_bytes(config.models_memory) if config.models_memory is not None else None,
                         max_loaded=config.max_loaded_models, keep_alive_s=parse_duration(config.keep_alive))


def make_loader(config: ServerConfig, replicas: int = 1, embedding_replicas: int = 1,
                log_dir: Path | None = None, ray_address: str | None = None) -> Loader:
    """How a catalog entry becomes a deployment: in-process, `replicas` engine processes, or
    (`ray_address`, chat models) `replicas` engine actors on Ray, created at the load and killed at
    the unload. An actor's memory is its Ray worker's, not this process's: its footprint is the
    floor (weights on disk and the KV budget, once per actor)."""
    from tokenpath.server.routing_config import engine_flags

    kv_budget = parse_bytes(config.engine.kv_cache_memory)

    async def load(entry: CatalogEntry) -> Loaded:
        before = rss_mib()
        dep: Deployment[Any, Any]
        procs: list[Any] = []
        if entry.task == "embedding" and embedding_replicas > 1:
            from tokenpath.server.embedding_deployments import embedding_process_deployment

            dep, closers = await embedding_process_deployment(entry.id, entry.source, embedding_replicas, log_dir)
            procs = dep.processes
        elif entry.task == "embedding":
            from tokenpath.server.deployments import load_embedding

            dep, closer = await asyncio.to_thread(load_embedding, entry.source)
            closers = [closer]
        elif ray_address is not None:
            from tokenpath.server.routing_config import ray_deployment

            dep, closers = await ray_deployment(entry.source, replicas, config.engine, ray_address)
        elif replicas > 1:
            from tokenpath.server.routing_config import replicated_deployment

            dep, closers = await replicated_deployment(entry.source, replicas, engine_flags(config.engine),
                                                       log_dir=log_dir)
            procs = dep.processes
        else:
            from tokenpath.server.deployments import load_chat

            dep, closer = await load_chat(entry.source, config, served=entry.id)
            closers = [closer]
        dep.name = entry.id
        floor = entry.size_hint + (kv_budget if entry.task != "embedding" else 0)
        if ray_address is not None and entry.task != "embedding":
            floor *= replicas
        return await _finish_load(dep, closers, procs, before, floor, config)

    return load


async def _finish_load(dep: Deployment[Any, Any], closers: list[Any], procs: list[Any], before: float,
                       floor: int, config: ServerConfig) -> Loaded:
    """A loaded deployment made ready to serve, with its measured footprint and its closer: what
    every loader (a catalog file, a routing file's on-demand deployment) does after building it."""
    from tokenpath.api.inputs import warm_tokenizers
    from tokenpath.replica.local import InProcessReplica
    from tokenpath.replica.local_embedding import InProcessEmbeddingReplica
    from tokenpath.routing.models import ModelRouter
    from tokenpath.server.routing_config import configure_liveness

    # What serve pays at start-up for the models it loads then (the longest-token scan, the chat
    # template's compile), paid here as part of the load, not by its first request.
    if dep.tokenizer is not None:
        await asyncio.to_thread(warm_tokenizers, [dep.tokenizer])
    configure_liveness(ModelRouter([dep]), config.liveness())
    grew = (sum(_proc_rss_mib(p) for p in procs) if procs else rss_mib() - before) * MIB
    footprint = int(max(grew, floor))

    async def close() -> None:
        results = await asyncio.gather(*(c() for c in closers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("error while stopping model %s: %r", dep.name, r)

    async def free() -> None:  # (holds nothing of the model: the catalog runs it after dropping it)
        await asyncio.to_thread(_free)

    # The in-process engines, not their replicas: a replica may go while its engine is still held.
    local = (InProcessReplica, InProcessEmbeddingReplica)
    engines = tuple(r.engine for r in dep.replicas if isinstance(r, local))
    return Loaded(dep, close, footprint, free, parts=engines)


def on_demand_catalog(specs: list[DeploymentSpec], config: ServerConfig, log_dir: Path | None,
                      taken: set[str] | frozenset[str] = frozenset()) -> ModelCatalog:
    """A routing file's `load: on_demand` deployments as a catalog: each is built by
    `build_deployment` on its first request (engine processes spawned, Ray actors created, URL
    replicas connected) and stopped when unloaded, under the serve command's budget and keep-alive.
    Before its first load its size is the model's weights on disk once per local engine process
    (a remote or Ray replica's memory is not this machine's); after, what was measured.

    With `--models-dir`, the directory's models (and the packaged ones) join the same catalog,
    each loaded as `serve --models-dir` loads it alone (in-process), under one budget with the
    routing file's. `taken`: the names the routing file serves at start (and the in-process
    embedding models): a packaged model of that name is left to them; a file in the directory
    with a name the routing file uses is a start-up error naming both, as two catalog entries
    with one id are."""
    from tokenpath.server.routing_config import build_deployment

    by_id = {s.name: s for s in specs}
    from_dir = make_loader(config, log_dir=log_dir)  # (the entries not in the routing file: --models-dir's)

    async def load(entry: CatalogEntry) -> Loaded:
        spec = by_id.get(entry.id)
        if spec is None:
            return await from_dir(entry)
        before = rss_mib()
        dep, closers = await build_deployment(spec, log_dir=log_dir)
        dep.name = entry.id
        return await _finish_load(dep, closers, dep.processes, before, entry.size_hint, config)

    entries = [CatalogEntry(s.name, s.model or s.name, s.task, size_hint=_spec_size(s)) for s in specs]
    if config.models_dir is not None:
        for entry in catalog_entries(config.models_dir, []):
            clash = entry.id in taken or entry.id in by_id
            if clash and entry.id in PACKAGED and entry.source == entry.id:
                continue  # (the packaged model is the routing file's to serve under that name)
            if clash:
                raise ValueError(f"--models-dir {config.models_dir}: model '{entry.id}' ({entry.source}) has the name "
                                 "of a deployment in the routing file; rename the file or the deployment")
            entries.append(entry)
    return ModelCatalog(entries, load, catalog_config(config))


def _spec_size(spec: DeploymentSpec) -> int:
    local = sum(r.local for r in spec.replicas)
    if not local:
        return 0
    from tokenpath.engine.loader import resolve_model_path

    try:
        return local * _disk_size(resolve_model_path(spec.model or spec.name))
    except Exception:  # (a model not found: its load says why)
        return 0


def _free() -> None:
    """Collect the unloaded engine's cycles and hand the freed heap back to the OS."""
    gc.collect()
    trim_heap()


def _proc_rss_mib(proc: Any) -> float:
    pid = getattr(getattr(proc, "proc", None), "pid", None)
    return 0.0 if pid is None else rss_mib(pid)


async def open_catalog(config: ServerConfig, pinned: list[str], replicas: int = 1, embedding_replicas: int = 1,
                       log_dir: Path | None = None, ray_address: str | None = None) -> ModelCatalog:
    """The catalog, its pinned models loaded (a pinned model that fails to load stops the start)."""
    from tokenpath.errors import ModelLoadError, TokenpathError

    if ray_address is not None:
        # Join the cluster now, before serve installs its signal handlers: joining installs Ray's
        # own SIGTERM handler (it exits at once), which at a first load would replace serve's
        # graceful shutdown. An unreachable cluster also stops the start here, as `--ray` does.
        from tokenpath.replica.ray_replica import connect

        connect(ray_address)
    catalog = ModelCatalog(catalog_entries(config.models_dir, pinned),
                           make_loader(config, replicas, embedding_replicas, log_dir, ray_address),
                           catalog_config(config))
    for entry in [catalog.entry(i) for i in catalog.ids()]:
        if entry.pinned:
            try:
                await catalog.load(entry.id)
            except TokenpathError as exc:
                await catalog.close()
                raise ModelLoadError(f"{entry.id}: {exc.message}") from None
    return catalog
