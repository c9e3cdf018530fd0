"""A real, engine-free replica that makes tokens on a timer.

It keeps the shape of an engine that matters to the layers above it: a batch of at most
`max_num_seqs` running requests, a FIFO of waiting ones, a KV usage figure, a prefix cache of
chained block hashes (a cached prefix shortens "prefill"), abort, and failure injection (`kill`).
Unit tests of admission, fair queueing and routing use it, and so can capacity experiments that
should not spend CPU on a model. End-to-end behaviour is tested against real engine replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from tokenpath.engine.block_hash import block_hashes
from tokenpath.errors import DuplicateRequestIdError, EngineDeadError
from tokenpath.protocol import GenerateRequest, ReplicaState, Submission
from tokenpath.protocol.outputs import CompletionOutput, EngineEvents, RequestOutput
from tokenpath.replica.base import ReplicaBusyError


@dataclass
class SimulatedConfig:
    max_num_seqs: int = 4
    token_interval_s: float = 0.01  # decode time per token
    prefill_s_per_block: float = 0.0  # prefill time per uncached prompt block
    block_size: int = 16
    max_cached_blocks: int = 4096


class SimulatedReplica:
    def __init__(self, name: str, config: SimulatedConfig | None = None) -> None:
        self.name = name
        self.config = config or SimulatedConfig()
        self.waiting: list[str] = []
        self.running: set[str] = set()
        self.cached: dict[int, None] = {}
        self.healthy = True
        self.served: list[str] = []  # request ids in the order they started
        self.fail_before_first = 0  # fail this many next requests before their first token
        self.busy_next = 0  # refuse this many next requests as busy (like a remote 429)
        self.raise_for: dict[str, BaseException] = {}  # request id -> what its own value makes it raise
        self.kv_per_seq = 0.5 / self.config.max_num_seqs  # a full batch uses half the KV cache
        self._slot_freed = asyncio.Event()
        self._aborted: set[str] = set()

    def state(self) -> ReplicaState:
        c = self.config
        return ReplicaState(name=self.name, waiting=len(self.waiting), running=len(self.running),
                            kv_usage=self.kv_per_seq * len(self.running), healthy=self.healthy,
                            prefix_hashes=set(self.cached), max_num_seqs=c.max_num_seqs,
                            block_size=c.block_size)

    def kill(self) -> None:
        """Like a dead engine process: unhealthy, and every in-flight stream fails."""
        self.healthy = False
        self._slot_freed.set()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self._slot_freed.set()

    async def _wait_for_slot(self, rid: str) -> None:
        self.waiting.append(rid)
        try:
            while len(self.running) >= self.config.max_num_seqs or self.waiting[0] != rid:
                self._check(rid)
                self._slot_freed.clear()
                await self._slot_freed.wait()
            self._check(rid)
        finally:
            self.waiting.remove(rid)
            self._slot_freed.set()  # let the next waiter re-check its position
        self.running.add(rid)

    def _check(self, rid: str) -> None:
        if not self.healthy:
            raise EngineDeadError(f"replica '{self.name}' is dead")
        if rid in self._aborted:
            raise asyncio.CancelledError

    async def generate(self, submission: Submission[GenerateRequest]) -> AsyncGenerator[RequestOutput, None]:
        request = submission.request
        rid = request.request_id
        if not self.healthy:
            raise EngineDeadError(f"replica '{self.name}' is dead")
        if self.busy_next > 0:
            self.busy_next -= 1
            raise ReplicaBusyError(f"replica '{self.name}' is busy")
        if rid in self.running or rid in self.waiting:  # as an engine refuses an id in use
            raise DuplicateRequestIdError(f"request id '{rid}' is already in use")
        events = EngineEvents(queued=time.monotonic())
        try:
            await self._wait_for_slot(rid)
        except asyncio.CancelledError:
            if rid in self._aborted:
                self._aborted.discard(rid)
                return
            raise
        try:
            events.scheduled = time.monotonic()
            self.served.append(rid)
            if rid in self.raise_for:  # one request's own bad value (the engine link's OverflowError)
                raise self.raise_for.pop(rid)
            if self.fail_before_first > 0:
                self.fail_before_first -= 1
                raise EngineDeadError(f"replica '{self.name}' failed before the first token")
            hashes = block_hashes(request.prompt_token_ids, self.config.block_size)
            hit = 0
            for h in hashes:
                if h not in self.cached:
                    break
                hit += 1
            await asyncio.sleep((len(hashes) - hit) * self.config.prefill_s_per_block)
            for h in hashes:
                self.cached[h] = None
            while len(self.cached) > self.config.max_cached_blocks:
                self.cached.pop(next(iter(self.cached)))
            n = request.params.max_tokens or 16
            for i in range(n):
                await asyncio.sleep(self.config.token_interval_s)
                if not self.healthy:
                    raise EngineDeadError(f"replica '{self.name}' died mid-stream")
                if rid in self._aborted:
                    return
                now = time.monotonic()
                events.first_token = events.first_token or now
                last = i == n - 1
                if last:
                    events.finished = now
                yield RequestOutput(
                    request_id=rid,
                    outputs=[CompletionOutput(index=0, text=f"t{i} ", token_ids=[i],
                                              finish_reason="length" if last else None)],
                    prompt_token_ids=request.prompt_token_ids, num_cached_tokens=hit * self.config.block_size,
                    finished=last, events=replace(events))
        finally:
            self.running.discard(rid)
            self._aborted.discard(rid)
            self._slot_freed.set()
