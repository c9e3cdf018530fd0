"""The in-process embedding replica: an `EmbeddingEngine` in this process behind the `Replica`
interface, so `/v1/embeddings` takes the same path as chat (admission, fair queue, picker,
Timeline stamping, ejection) and an embedding model can swap to engine processes
(`embedding_link.py`) without the API noticing.

`generate` yields exactly one `EmbeddingOutput`. The engine shares the gateway's clock, so its
event times pass as they are.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenpath.engine.embedding import EmbeddingEngine
from tokenpath.errors import EngineDeadError
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, ReplicaState
from tokenpath.protocol.submission import Submission


class InProcessEmbeddingReplica:
    def __init__(self, engine: EmbeddingEngine, name: str) -> None:
        self.engine = engine
        self.name = name

    async def generate(self, submission: Submission[EmbeddingRequest]) -> AsyncGenerator[EmbeddingOutput, None]:
        if not self.engine.healthy:
            raise EngineDeadError(f"the embedding engine of replica '{self.name}' failed a forward pass")
        yield await self.engine.run(submission.request)

    async def abort(self, request_id: str) -> None:
        """Nothing to do: closing `generate` cancels the caller's batch items, which the batcher
        skips if their forward pass has not started."""

    def state(self) -> ReplicaState:
        return self.engine.state(self.name)

    async def close(self) -> None:
        await self.engine.shutdown()
