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
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, GenerateRequest, RequestOutput
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


def load_embedding(name: str) -> tuple[Deployment[EmbeddingRequest, EmbeddingOutput], Closer]:
    """The in-process default: one `InProcessEmbeddingReplica`, behind admission like chat; and
    what stops it."""
    from tokenpath.replica.local_embedding import InProcessEmbeddingReplica

    served, engine = load_embedding_engine(name)
    replica = InProcessEmbeddingReplica(engine, name=f"local:{served}")
    dep = Deployment(name=served, task="embedding", replicas=[replica], tokenizer=engine.tokenizer,
                     max_model_len=engine.max_seq_len, dimensions=engine.dimensions, policy="least_loaded")
    return dep, replica.close


async def load_chat(name: str, config: ServerConfig,
                    served: str | None = None) -> tuple[Deployment[GenerateRequest, RequestOutput], Closer]:
    """One in-process engine of `name` (as `served`, a catalog's id, when given); and what stops it."""
    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.replica.local import InProcessReplica

    update: dict[str, Any] = {"model": name} | ({"served_model_name": served} if served else {})
    engine_cfg = config.engine.replace(**update)
    engine = await asyncio.to_thread(AsyncEngine, engine_cfg)
    await engine.start()
    replica = InProcessReplica(engine, deployment=engine.model_name, liveness=config.liveness())
    dep = Deployment(name=engine.model_name, task="chat", replicas=[replica],
                     tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                     model_config=engine.core.model_config, max_lora_rank=engine_cfg.max_lora_rank)
    return dep, replica.close


async def load_deployments(config: ServerConfig) -> tuple[list[Deployment[Any, Any]], list[Closer]]:
    deployments: list[Deployment[Any, Any]] = []
    closers: list[Closer] = []
    for name in config.models:
        dep: Deployment[Any, Any]
        if is_embedding_model(name):
            dep, closer = await asyncio.to_thread(load_embedding, name)
        else:
            dep, closer = await load_chat(name, config)
        closers.append(closer)
        deployments.append(dep)
    return deployments, closers
