"""Turn a list of model names into loaded deployments (one in-process replica each, chat or embedding).

Loading happens in a worker thread before the server binds, so start-up errors (a missing
model, a bad file) stop `tokenpath serve` with the file and the problem, not a half-up server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tokenpath.config import DEFAULT_EMBEDDING_MODEL
from tokenpath.routing.models import Deployment
from tokenpath.server.config import ServerConfig, is_embedding_model

Closer = Callable[[], Awaitable[None]]


def load_embedding_engine(name: str) -> tuple[str, Any]:
    """(the name clients send, a loaded `EmbeddingEngine`): in the gateway or an engine process."""
    from tokenpath.engine.embedding import EmbeddingEngine

    engine = EmbeddingEngine.from_dir(None if name == DEFAULT_EMBEDDING_MODEL else name)
    return embedding_served_name(name), engine


def embedding_served_name(name: str) -> str:
    return name if name == DEFAULT_EMBEDDING_MODEL else Path(name).name


def load_embedding(name: str) -> Deployment:
    """The in-process default: one `InProcessEmbeddingReplica`, behind admission like chat."""
    from tokenpath.replica.local_embedding import InProcessEmbeddingReplica

    served, engine = load_embedding_engine(name)
    replica = InProcessEmbeddingReplica(engine, name=f"local:{served}")
    return Deployment(name=served, task="embedding", replicas=[replica], tokenizer=engine.tokenizer,
                      max_model_len=engine.max_seq_len, dimensions=engine.dimensions, policy="least_loaded")


async def load_chat(name: str, config: ServerConfig) -> tuple[Deployment, Closer]:
    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.replica.local import InProcessReplica

    engine_cfg = config.engine.model_copy(update={"model": name})
    engine = await asyncio.to_thread(AsyncEngine, engine_cfg)
    await engine.start()
    replica = InProcessReplica(engine, deployment=engine.model_name, liveness=config.liveness())
    dep = Deployment(name=engine.model_name, task="chat", replicas=[replica],
                     tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                     model_config=engine.core.model_config, max_lora_rank=engine_cfg.max_lora_rank)
    return dep, replica.close


async def load_deployments(config: ServerConfig) -> tuple[list[Deployment], list[Closer]]:
    deployments: list[Deployment] = []
    closers: list[Closer] = []
    for name in config.models:
        if is_embedding_model(name):
            dep = await asyncio.to_thread(load_embedding, name)
            closers += [r.close for r in dep.replicas]  # type: ignore[attr-defined]
        else:
            dep, closer = await load_chat(name, config)
            closers.append(closer)
        deployments.append(dep)
    return deployments, closers
