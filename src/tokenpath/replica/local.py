"""The in-process replica: an `AsyncEngine` in this process behind the `Replica` interface."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.engine.outputs import RequestOutput
from tokenpath.replica.base import GenerateRequest, ReplicaState


class InProcessReplica:
    def __init__(self, engine: AsyncEngine, name: str | None = None) -> None:
        self.engine = engine
        self.name = name or f"local:{engine.model_name}"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request.prompt_token_ids, request.params, request.request_id,
                                              priority=request.priority, timeline=request.timeline,
                                              prompt=request.prompt):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def reset_prefix_cache(self) -> int:
        return self.engine.core.blocks.reset_prefix_cache()

    def state(self) -> ReplicaState:
        s = self.engine.state()
        return ReplicaState(
            name=self.name,
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            healthy=s.healthy,
            prefix_hashes=self.engine.core.blocks.cached_hashes(),
            max_num_seqs=self.engine.config.max_num_seqs,
            block_size=s.block_size,
            num_blocks=s.num_blocks,
        )
