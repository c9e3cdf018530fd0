"""The in-process replica: an `AsyncEngine` in this process behind the `Replica` interface.

It shares the gateway's clock, so the engine's event times are passed on as they are. If the
engine's step loop dies, the replica reports itself unhealthy at once (so the pool ejects it and
`/health` says why) and rebuilds the engine in the background with exponential backoff; once the
new engine runs, state says healthy and the pool re-admits it.

A step loop that hangs instead of dying (a native call that never returns, a blocked thread) is
found by the same `replica.liveness`, with the same rule, as one in an engine process: one step
(`AsyncEngine.step_beat`) running past `liveness.hang_bound`, the stall bound or `STEP_SLACK`
times what a normal step of its size takes if that is longer (`FIRST_STEP_S` before its first step
has ended: that one pays the engine's one-time setup; a fresh server's first forward took over 2 s
on a loaded machine). Here the engine is read on each judgement instead of pushing its state. Then
the replica is ejected (`state()` unhealthy, `/health` says why), its in-flight requests are
released (retried elsewhere before their first token, else a clean 503 or an SSE error event), new
ones are refused at once, and the engine is told to abort them; the step's return recovers it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.protocol import GenerateRequest, ReplicaState, RequestOutput
from tokenpath.protocol.submission import Submission
from tokenpath.replica.liveness import Liveness, LivenessConfig, hang_bound
from tokenpath.telemetry import series

log = logging.getLogger("tokenpath.replica")

RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
STOP_WAIT_S = 30.0  # at close, how long a step that is still moving may take to end


class InProcessReplica:
    def __init__(self, engine: AsyncEngine, name: str | None = None, deployment: str | None = None,
                 liveness: LivenessConfig | None = None) -> None:
        self.engine = engine
        self.name = name or f"local:{engine.model_name}"
        self.deployment = deployment or engine.model_name
        self.restarts = 0
        self._restarting: asyncio.Task | None = None
        self._closed = False
        self.liveness = Liveness(self.name, liveness, poll=self._poll_engine)
        self.liveness.deployment = self.deployment

    def _poll_engine(self, liveness: Liveness) -> None:
        """What the step thread is doing, read (it cannot push): see the module docstring."""
        engine, now = self.engine, time.monotonic()
        liveness.active = engine.healthy  # (a dead loop is the restart's business, not a stall)
        liveness.heard(now)  # (the engine's process is this one: only its step loop can be late)
        age, allowance = engine.step_beat(now)
        liveness.stepped(now - age, allowance)
        engine.step_ceiling_s = hang_bound(liveness.config.stall_after_s, allowance)

    async def generate(self, submission: Submission[GenerateRequest]) -> AsyncGenerator[RequestOutput, None]:
        """The bare request goes to the engine; each output it yields is new and this stream's
        alone, so the prompt's text (which the engine never had) is set on it here."""
        engine, rid, prompt = self.engine, submission.request_id, submission.prompt
        progress = self.liveness.track(rid, lambda exc: engine.fail(rid, exc))  # (refused at once while stalled)
        try:
            async for out in engine.generate(submission.request):
                progress.advance(time.monotonic())
                out.prompt = prompt
                yield out
        finally:
            self.liveness.untrack(rid)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def step_stats(self) -> dict[str, list]:
        """The engine's cumulative step histograms (`telemetry.engine_steps`)."""
        return self.engine.step_stats.snapshot()

    def state(self) -> ReplicaState:
        s = self.engine.state()
        if not s.healthy:
            self._supervise()
        detail = None
        if not s.healthy:
            detail = f"engine step loop died: {self.engine.error!r}; restarting" if self.engine.error else "starting"
        else:
            detail = self.liveness.detail()
        return ReplicaState(
            name=self.name,
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            kv_resident_bytes=s.kv_resident_bytes,
            healthy=detail is None,
            prefix_hashes=self.engine.core.blocks.cached_hashes(), prefix_reported=True,
            max_num_seqs=self.engine.config.max_num_seqs,
            block_size=s.block_size,
            num_blocks=s.num_blocks,
            detail=detail,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            restarts=self.restarts,
            loras=frozenset(s.loras),
            running_loras=tuple(s.running_loras),
            waiting_loras=tuple(s.waiting_loras),
            max_loras=s.max_loras,
            spec_decode=tuple(s.spec_decode),
            moe_experts=tuple(s.moe_experts),
            waiting_deferred=s.waiting_deferred,
            waiting_preempted=s.waiting_preempted,
            can_preempt=True,
        )

    def _supervise(self) -> None:
        if self._closed or self.engine.error is None or (self._restarting and not self._restarting.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._restarting = loop.create_task(self._restart())

    async def _restart(self) -> None:
        log.warning("replica %s: engine step loop died (%r); restarting it", self.name, self.engine.error)
        delay = RESTART_BASE_S
        while not self._closed:
            old = self.engine
            try:
                await old.shutdown()
                engine = await asyncio.to_thread(AsyncEngine, old.config)
                await engine.start()
            except Exception:
                log.exception("replica %s: restart failed; next try in %.0fs", self.name, delay)
                await asyncio.sleep(delay)
                delay = min(RESTART_MAX_S, delay * 2)
                continue
            self.engine = engine
            self.restarts += 1
            series.REPLICA_RESTARTS.labels(self.deployment, self.name).inc()
            log.info("replica %s: engine restarted (restart %d); healthy again", self.name, self.restarts)
            return

    async def close(self) -> None:
        """Stop the engine. A hung step is not waited for past its stall bound: shutdown must end
        within `--shutdown-timeout` plus a moment whatever the engine does (issue 23)."""
        self._closed = True
        if self._restarting is not None:
            self._restarting.cancel()
        lv = self.liveness
        wait = 0.5 if lv.stalled or lv.detail() else min(STOP_WAIT_S, lv.bound - lv.step_running_for() + 0.5)
        await lv.stop()
        await self.engine.shutdown(timeout=max(0.5, wait))
