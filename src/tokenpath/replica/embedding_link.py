"""The engine link for embedding models, both ends: one more message kind on the same link.

An embedding engine process speaks the chat link's handshake (secret, `welcome` with its info),
clock sync (`ping`/`pong`), state push and `abort`; what differs is one request kind:

- `embed` (gateway -> engine): an `EmbeddingRequest` (`protocol.embedding_wire`);
- `vec` (engine -> gateway): its `EmbeddingOutput`, float32 vectors plus the engine's event
  times, shifted into the gateway's clock on receipt like a chat delta's; `err` as for chat.

So `tokenpath serve --embedding-replicas N` (or a routing file's embedding deployment with
`local: N`) runs the encoder in N processes behind the same pool, admission and picker as chat.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from tokenpath.engine.embedding import EmbeddingEngine
from tokenpath.errors import TokenpathError
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest
from tokenpath.protocol.embedding_wire import (
    decode_embedding_output,
    decode_embedding_request,
    encode_embedding_output,
    encode_embedding_request,
)
from tokenpath.replica.link_client import EngineLinkReplica
from tokenpath.replica.link_server import LinkServer, Outbox, _error

log = logging.getLogger("tokenpath.engine.link")


class EmbeddingLinkReplica(EngineLinkReplica):
    """The gateway end: a `Replica` whose `generate` takes an `EmbeddingRequest`."""

    @property
    def dimensions(self) -> int:
        return int(self.info.extra.get("dimensions") or 0)

    def generate(self, request: EmbeddingRequest) -> AsyncIterator[EmbeddingOutput]:  # type: ignore[override]
        return self._stream(request, {"t": "embed", "req": encode_embedding_request(request)}, lambda _: True)

    def _on_frame(self, kind: str, msg: dict) -> None:
        if kind != "vec":
            return
        entry = self._streams.get(msg["id"])
        if entry is not None:
            out = decode_embedding_output(msg)
            out.events = out.events.shifted(-self.offset)
            self._deliver(entry, out)

    async def reset_prefix_cache(self) -> int:
        return 0  # an encoder keeps no prefix cache


class EmbeddingLinkServer(LinkServer):
    """The engine end: an `EmbeddingEngine` served over the link."""

    engine: EmbeddingEngine  # type: ignore[assignment]

    def __init__(self, engine: EmbeddingEngine, secret: str, model_name: str, exit_on_close: bool = False) -> None:
        super().__init__(engine, secret, exit_on_close=exit_on_close)  # type: ignore[arg-type]
        self.model_name = model_name

    def _info(self) -> dict:
        e = self.engine
        return {"model": self.model_name, "max_model_len": e.max_seq_len, "block_size": 16, "num_blocks": 0,
                "max_num_seqs": e.max_batch_size, "dimensions": e.dimensions, "task": "embedding",
                "pid": os.getpid()}

    def _state(self) -> dict:
        s = self.engine.state("")
        return {"t": "state", "waiting": s.waiting, "running": s.running, "kv": 0.0, "healthy": s.healthy,
                "pq": 0, "ph": 0, "pre": 0, "steps": self.engine.num_batches, "num_blocks": 0, "block_size": 16}

    def _on_frame(self, kind: str, msg: dict, outbox: Outbox, tasks: dict[str, asyncio.Task]) -> None:
        if kind != "embed":
            return
        d = msg.get("req") or {}
        try:
            request = decode_embedding_request(d)
        except Exception as exc:  # a malformed frame from a trusted peer: this request's problem only
            outbox.send({"t": "err", "id": str(d.get("id")), "status": 400,
                         "message": f"malformed embedding request: {exc}", "type": "invalid_request_error"})
            return
        task = asyncio.create_task(self._embed(request, outbox))
        tasks[request.request_id] = task
        task.add_done_callback(lambda _t, rid=request.request_id: tasks.pop(rid, None))

    async def _embed(self, request: EmbeddingRequest, outbox: Outbox) -> None:
        try:
            outbox.send(encode_embedding_output(await self.engine.run(request)))
            await outbox.drain()
        except TokenpathError as exc:
            outbox.send(_error(request.request_id, exc))
        except Exception as exc:
            log.exception("embedding request %s failed", request.request_id)
            outbox.send({"t": "err", "id": request.request_id, "status": 503, "type": "service_unavailable",
                         "message": f"{type(exc).__name__}: {exc}"})
