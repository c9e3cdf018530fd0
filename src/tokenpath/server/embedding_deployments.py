"""Embedding models as engine processes: `serve --embedding-replicas N`, or a routing file's
deployment with `task: embedding` and `replicas: [{local: N}]`.

Each process is `tokenpath engine --model <embedding model>`, linked over the engine link's
embedding messages (`replica.embedding_link`), supervised and restarted like a chat engine.
The gateway keeps only the tokenizer (it validates and tokenizes once, at the edge) and learns
the encoder's position limit and vector size from the engines' `welcome`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.config import DEFAULT_EMBEDDING_MODEL
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest
from tokenpath.replica.embedding_link import EmbeddingLinkReplica
from tokenpath.replica.pool import PoolConfig
from tokenpath.replica.processes import spawn_engines
from tokenpath.routing.models import Deployment

EmbeddingDeployment = Deployment[EmbeddingRequest, EmbeddingOutput]

Closer = Callable[[], Awaitable[None]]
EMBEDDING_POLICY = "least_loaded"  # an encoder caches nothing, so prefix affinity buys nothing


def embedding_tokenizer(model: str) -> Any:
    from tokenpath.engine.embedding import EmbeddingTokenizer, default_embedding_model_dir

    model_dir = default_embedding_model_dir() if model == DEFAULT_EMBEDDING_MODEL else Path(model)
    return EmbeddingTokenizer(model_dir / "tokenizer.json")


async def embedding_process_deployment(name: str, model: str, n: int, log_dir: Path | None = None,
                                       policy: str = EMBEDDING_POLICY, admission: dict | None = None,
                                       pool: dict | None = None) -> tuple[EmbeddingDeployment, list[Closer]]:
    """`n` supervised embedding engine processes of `model`, served as deployment `name`."""
    procs = await spawn_engines(n, model, [], log_dir=log_dir, name_prefix="embed", deployment=name,
                                link=EmbeddingLinkReplica)
    try:
        tokenizer = await asyncio.to_thread(embedding_tokenizer, model)
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        raise
    info = procs[0].replica.info  # (what the first engine said in its `Welcome`: they all run `model`)
    dep = Deployment(name, "embedding", [p.replica for p in procs], tokenizer=tokenizer,
                     max_model_len=info.max_model_len, dimensions=info.dimensions, policy=policy,
                     admission=AdmissionConfig(**(admission or {})), pool_config=PoolConfig(**(pool or {})))
    dep.processes = procs
    return dep, [p.stop for p in procs]


async def embedding_deployments(models: list[str], replicas: int, skip: set[str],
                                log_dir: Path | None = None) -> tuple[list[EmbeddingDeployment], list[Closer]]:
    """The embedding models among `models` (but those named in `skip`, which a routing file
    configures itself): in-process, or `replicas` engine processes each when `replicas > 1`."""
    from tokenpath.server.config import is_embedding_model
    from tokenpath.server.deployments import embedding_served_name, load_embedding

    deployments: list[EmbeddingDeployment] = []
    closers: list[Closer] = []
    try:
        for m in models:
            if not is_embedding_model(m) or embedding_served_name(m) in skip:
                continue
            if replicas > 1:
                dep, more = await embedding_process_deployment(embedding_served_name(m), m, replicas, log_dir)
            else:
                dep, closer = await asyncio.to_thread(load_embedding, m)
                more = [closer]
            deployments.append(dep)
            closers += more
    except BaseException:
        await asyncio.gather(*(c() for c in closers), return_exceptions=True)
        raise
    return deployments, closers
