"""The engine link for embedding models, both ends: one more message kind on the same link.

An embedding engine process speaks the chat link's handshake (secret, `Welcome` with its
`LinkInfo`, whose `dimensions` it sets), clock sync, state push and `Abort`; what differs is
one request kind (both in `protocol.wire`, the link's one codec):

- `embed` (gateway -> engine): an `EmbeddingRequest`;
- `vec` (engine -> gateway): its `EmbeddingOutput`, float32 vectors plus the engine's event
  times, shifted into the gateway's clock on receipt like a chat delta's; `LinkError` as for chat.

So `tokenpath serve --embedding-replicas N` (or a routing file's embedding deployment with
`local: N`) runs the encoder in N processes behind the same pool, admission and picker as chat.
"""

from __future__ import annotations

import asyncio
import logging
import os

from tokenpath.engine.embedding import EmbeddingEngine
from tokenpath.errors import TokenpathError
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, EngineState
from tokenpath.protocol.link import LinkError, LinkInfo
from tokenpath.protocol.wire import decode_embedding_request
from tokenpath.replica.link_client import LinkReplica
from tokenpath.replica.link_server import InFlight, LinkEndpoint, Outbox

log = logging.getLogger("tokenpath.engine.link")


class EmbeddingLinkReplica(LinkReplica[EmbeddingRequest, EmbeddingOutput]):
    """The gateway end: a `Replica[EmbeddingRequest, EmbeddingOutput]` (`generate` is the link's
    own: it sends the `embed` frame and yields the one `vec` that answers it)."""

    @property
    def dimensions(self) -> int:
        return self.info.dimensions

    async def reset_prefix_cache(self) -> int:
        return 0  # an encoder keeps no prefix cache


class EmbeddingLinkServer(LinkEndpoint[EmbeddingEngine]):
    """The engine end: an `EmbeddingEngine` served over the link."""

    REQUEST_FRAMES = ("embed",)

    def __init__(self, engine: EmbeddingEngine, secret: str, model_name: str, exit_on_close: bool = False) -> None:
        super().__init__(engine, secret, exit_on_close=exit_on_close)
        self.model_name = model_name

    def _info(self) -> LinkInfo:
        e = self.engine
        return LinkInfo(model=self.model_name, max_model_len=e.max_seq_len, block_size=16, num_blocks=0,
                        max_num_seqs=e.max_batch_size, pid=os.getpid(), task="embedding", dimensions=e.dimensions)

    def _state(self) -> EngineState:
        s = self.engine.state("")
        return EngineState(waiting=s.waiting, running=s.running, healthy=s.healthy, steps=self.engine.num_batches,
                           block_size=16)

    def _on_request(self, kind: str, d: dict, outbox: Outbox, live: dict[str, InFlight]) -> None:
        try:
            request = decode_embedding_request(d)
        except Exception as exc:  # a malformed frame from a trusted peer: this request's problem only
            outbox.send(LinkError.malformed(str(d.get("id")), exc, "embedding request"))
            return
        task = asyncio.create_task(self._embed(request, outbox))
        rid = request.request_id
        live[rid] = task  # (an abort cancels it: the batcher skips it if its batch has not started)
        task.add_done_callback(lambda _t: live.pop(rid, None))

    async def _embed(self, request: EmbeddingRequest, outbox: Outbox) -> None:
        try:
            outbox.send(await self.engine.run(request))
            await outbox.drain()
        except Exception as exc:
            if not isinstance(exc, TokenpathError):
                log.exception("embedding request %s failed", request.request_id)
            outbox.send(LinkError.of(request.request_id, exc))
