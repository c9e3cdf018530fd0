"""The gateway end of the engine link: a `Replica` backed by one of tokenpath's engine processes.

One connection per engine, multiplexing every request: `add` frames carry the `GenerateRequest`
of the gateway's `Submission` (priority, deadline, tenant, request id, trace context and
adapter; the submission's Timeline, prompt text and session id stay here, and the prompt is put
on each decoded output, as an in-process replica does), `out` frames bring back `RequestOutput`
deltas (token ids, text, logprobs, event times), `abort` cancels, and the engine pushes its
`state` every 100 ms. The gateway never re-tokenizes: text deltas come from the engine's
detokenizer, which also applies the stop strings.

Clocks: each process has its own monotonic clock (the same one on Linux today, but the link does
not rely on it). At connect the client sends a few pings and keeps the offset from the one with
the shortest round trip, NTP-style: `offset = engine_now - (sent + received) / 2`, accurate to
half that round trip (tens of microseconds on loopback). Engine event times are shifted by it on
receipt, and `replica.events.stamp_events` clamps them into what the gateway saw.

Health: unhealthy the moment the link closes (a dead or killed engine: at once), or when nothing
has arrived for the stall bound (an engine that is alive but frozen or wedged), or when its state
pushes say one step has been running past the hang bound (a step thread stuck while the process's
event loop, and so the link, lives on: `EngineState.step_age_s`, judged by the same rule as an
in-process engine's). Then `replica.liveness` ejects it and releases its in-flight requests
(retried elsewhere before their first token, a clean 503 after). The bound (`STALE_AFTER_S` by default) is not tighter on purpose:
on a busy machine a push, or the gateway's own reading of it, can lag by over a second, and a 1 s
limit then turned every replica "unhealthy" together and answered 503 no_healthy_replica (seen in
the soak, benchmarks/results/soak_before.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Generic

from tokenpath import errors
from tokenpath.errors import EngineDeadError, ServiceUnavailableError, TokenpathError
from tokenpath.protocol import EmbeddingOutput, EngineState, GenerateRequest, ReplicaState, RequestOutput
from tokenpath.protocol.link import (
    Abort,
    Hello,
    LinkError,
    LinkInfo,
    Ping,
    Pong,
    Reset,
    ResetDone,
    StallBound,
    Welcome,
)
from tokenpath.protocol.outputs import EngineEvents
from tokenpath.protocol.submission import Submission
from tokenpath.protocol.wire import FrameError, FrameReader, decode, decode_output, frame, read_frame
from tokenpath.replica.base import OutT, ReqT
from tokenpath.replica.liveness import STALL_AFTER_S, Liveness, LivenessConfig, Progress

log = logging.getLogger("tokenpath.replica")

# A closed socket marks a dead engine at once; this catches a hung one. Not tighter: on a loaded
# machine a 100 ms state push can arrive seconds late (seen at load average 15+ on 2 cores, where
# a 1 s limit marked both live engines stale together), and a stale mark turns requests away with 503.
STALE_AFTER_S = STALL_AFTER_S
CONNECT_TIMEOUT_S = 10.0
SYNC_PINGS = 5


class LinkRefusedError(ServiceUnavailableError):
    """The engine refused the link (a wrong secret)."""


class _Stream:
    """One request in flight on the link: what `_dispatch` needs to hand it its outputs."""

    __slots__ = ("events", "progress", "prompt", "queue", "request")

    def __init__(self, request: Any, prompt: str | None, queue: asyncio.Queue, progress: Progress) -> None:
        self.request, self.prompt, self.queue, self.progress = request, prompt, queue, progress
        self.events: EngineEvents | None = None  # its last engine events, in this clock (`OutputFrames`)


class LinkReplica(Generic[ReqT, OutT]):
    """The link's gateway end for one request kind: `Replica[ReqT, OutT]`. The connection, clock
    sync, state, liveness and streams are the same for every kind; `generate` sends the bare
    request (its frame type chosen by `protocol.wire.encode`) and yields the outputs that answer it
    (`EngineLinkReplica`: generations; `embedding_link.EmbeddingLinkReplica`: embeddings)."""

    def __init__(self, name: str, secret: str, max_num_seqs: int = 0,
                 liveness: LivenessConfig | None = None) -> None:
        self.name = name
        self.secret = secret
        self.info = LinkInfo()
        self.max_num_seqs = max_num_seqs
        self.offset = 0.0  # engine clock minus ours
        self.restarts = 0
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._streams: dict[str, _Stream] = {}
        self._pongs: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._state = EngineState()  # the engine's last state message
        # The engine's prefix index as its KV events tell it (each link starts with a clear and a
        # snapshot); `_reported` once any arrived (an engine of an older version sends none).
        self._held: set[int] = set()
        self._reported = False
        self.liveness = Liveness(name, liveness)  # stall and per-request progress bounds
        self.liveness.active = False  # (judged while linked)
        self._bound_sent = 0.0  # the stall bound the engine was last told (`StallBound`)
        self._down_reason: str | None = "not connected yet"

    # -- connection ------------------------------------------------------------------------------
    async def connect(self, host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Link to an engine; `timeout` covers its start-up (it answers once its model is loaded)."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        writer.write(frame(Hello(self.secret)))
        try:
            welcome = decode(await asyncio.wait_for(read_frame(reader), timeout))
        except BaseException:
            writer.close()
            raise
        if not isinstance(welcome, Welcome):
            writer.close()
            raise LinkRefusedError(f"engine {self.name} refused the link: {getattr(welcome, 'message', welcome)}")
        self.info = welcome.info
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._writer = writer
        self._bound_sent = 0.0  # (a new engine: tell it with its first state)
        self.liveness.forget_steps()  # (those of the engine before a restart say nothing of this one)
        self._reader_task = asyncio.create_task(self._read(reader, writer))
        await self._sync_clock()
        self._down_reason = None
        self.liveness.heard(time.monotonic())
        self.liveness.active = True
        self.liveness.start()

    async def _sync_clock(self) -> None:
        best: tuple[float, float] | None = None  # (rtt, offset)
        for _ in range(SYNC_PINGS):
            pid = next(self._ids)
            fut = asyncio.get_running_loop().create_future()
            self._pongs[pid] = fut
            sent = time.monotonic()
            self._send(Ping(pid))
            engine_now = await asyncio.wait_for(fut, CONNECT_TIMEOUT_S)
            got = time.monotonic()
            rtt, offset = got - sent, engine_now - (sent + got) / 2
            if best is None or rtt < best[0]:
                best = (rtt, offset)
        assert best is not None
        self.offset = best[1]

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "link closed"
        frames = FrameReader(reader)
        try:
            while True:
                msgs = await frames.read_frames()
                self.liveness.heard(time.monotonic())  # (once per read: outputs and state alike)
                for msg in msgs:
                    self._dispatch(msg)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError, OSError) as exc:
            reason = f"link closed ({type(exc).__name__})"
        finally:
            if self._writer is writer:  # (not a reader of an older link, replaced by a reconnect)
                self.mark_down(reason)

    def _dispatch(self, msg: dict) -> None:
        """One frame from the engine, to the request stream or future waiting for it."""
        if msg["t"] == "out":  # (most frames: decoded against the request they answer)
            entry = self._streams.get(msg["id"])
            if entry is not None:
                if msg["ev"] is None:  # unchanged since its last frame: the same (shifted) events
                    out = decode_output(msg, entry.request, entry.events, entry.prompt)
                else:
                    out = decode_output(msg, entry.request, None, entry.prompt)
                    out.events = entry.events = out.events.shifted(-self.offset)
                self._deliver(entry, out)
            return
        m = decode(msg)
        if isinstance(m, EngineState):
            self._state = m
            if m.kv_events:
                self._apply_kv_events(m.kv_events)
            if m.step_age_s is not None:  # (an engine that reports its step loop)
                self.liveness.stepped(self.liveness.heard_at - m.step_age_s, m.step_allowance_s)
            if self._bound_sent != (bound := self.liveness.config.stall_after_s):
                self._bound_sent = bound  # (the serve command sets it after the engines are linked)
                with contextlib.suppress(TokenpathError):
                    self._send(StallBound(bound))
        elif isinstance(m, EmbeddingOutput):
            entry = self._streams.get(m.request_id)
            if entry is not None:
                m.events = m.events.shifted(-self.offset)
                self._deliver(entry, m)
        elif isinstance(m, LinkError):
            entry = self._streams.get(m.id)
            if entry is not None:
                entry.queue.put_nowait(m.exception(self.name))
        elif isinstance(m, Pong | ResetDone):
            fut = self._pongs.pop(m.id, None)
            if fut is not None and not fut.done():
                fut.set_result(float(m.now if isinstance(m, Pong) else m.freed))

    def _deliver(self, entry: _Stream, out: Any) -> None:
        """An output for a request in flight: to its reader, and its progress noted."""
        entry.progress.advance(self.liveness.heard_at)
        entry.queue.put_nowait(out)

    def mark_down(self, reason: str) -> None:
        """The engine is gone (link closed or process died): fail every stream in flight now."""
        if self._down_reason is None:
            log.warning("replica %s: engine link down: %s", self.name, reason)
        self._down_reason = reason
        self.liveness.active = False
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        dead = EngineDeadError(f"engine process of replica '{self.name}' went away: {reason}")
        for entry in self._streams.values():
            entry.queue.put_nowait(dead)

    def _send(self, msg: object) -> None:
        self._write(frame(msg))

    def _write(self, data: bytes) -> None:
        if self._writer is None:
            raise EngineDeadError(f"replica '{self.name}' is down: {self._down_reason}")
        self._writer.write(data)

    async def close(self) -> None:
        self._down_reason = self._down_reason or "closed by the gateway"  # (expected: not a warning)
        self.mark_down("closed by the gateway")
        await self.liveness.stop()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task

    # -- the Replica interface --------------------------------------------------------------------
    async def generate(self, submission: Submission[ReqT]) -> AsyncGenerator[OutT, None]:
        """One request over the link: send the bare request, yield what `_dispatch` queues for it
        until one is `finished` (an embedding's one output always is), raise an error it queues,
        and abort it on the engine if the caller stops early."""
        request = submission.request
        rid = request.request_id
        if rid in self._streams:
            raise errors.DuplicateRequestIdError(f"request id '{rid}' is already in use")
        try:  # encoded before anything is tracked or sent: a value the codec cannot carry is this
            data = frame(request)  # request's fault, a 400, never the replica's (it once ejected it)
        except (OverflowError, ValueError, TypeError) as exc:
            raise errors.InvalidRequestError(f"request '{rid}' holds a value the engine link cannot carry: {exc}",
                                             code="value_out_of_range") from None
        queue: asyncio.Queue = asyncio.Queue()
        progress = self.liveness.track(rid, queue.put_nowait)  # (refused at once while stalled)
        try:
            self._write(data)
        except BaseException:
            self.liveness.untrack(rid)
            raise
        self._streams[rid] = _Stream(request, submission.prompt, queue, progress)
        done = False
        try:
            while not done:
                item = await queue.get()
                if isinstance(item, errors.DuplicateRequestIdError):  # the engine refused it before
                    done = True  # taking it on: an abort would stop the other request holding the id
                if isinstance(item, BaseException):
                    raise item
                done = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            self.liveness.untrack(rid)
            if not done:  # (to a frozen engine too: the socket keeps the frame until it wakes)
                with contextlib.suppress(TokenpathError):
                    self._send(Abort(rid))

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(TokenpathError):
            self._send(Abort(request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's prefix cache (POST /reset_prefix_cache reaches every replica)."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pongs[rid] = fut
        self._send(Reset(rid))
        try:
            return int(await asyncio.wait_for(fut, CONNECT_TIMEOUT_S))
        finally:
            self._pongs.pop(rid, None)

    def step_stats(self) -> dict[str, list] | None:
        """The engine's cumulative step histograms, as of its last state message."""
        return self._state.step_stats

    def state(self) -> ReplicaState:
        s = self._state
        detail = self._down_reason or self.liveness.detail()
        if detail is None and not s.healthy:
            detail = "the engine reports its step loop dead"
        return ReplicaState(
            name=self.name, waiting=s.waiting, running=s.running, kv_usage=s.kv_usage, healthy=detail is None,
            kv_resident_bytes=s.kv_resident_bytes,
            max_num_seqs=self.max_num_seqs or self.info.max_num_seqs,
            block_size=s.block_size or self.info.block_size, num_blocks=s.num_blocks or self.info.num_blocks,
            detail=detail, prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, restarts=self.restarts,
            loras=frozenset(map(str, s.loras)), running_loras=tuple(map(str, s.running_loras)),
            waiting_loras=tuple(map(str, s.waiting_loras)), max_loras=int(s.max_loras),
            prefix_hashes=self._held, prefix_reported=self._reported,
            spec_decode=tuple(map(int, s.spec_decode)), moe_experts=tuple(map(int, s.moe_experts)),
            waiting_deferred=int(s.waiting_deferred), waiting_preempted=int(s.waiting_preempted),
            can_preempt=True)

    def _apply_kv_events(self, events: list[list[int]]) -> None:
        """Group 0's index, as the engine changed it: [kind, hash] pairs (`EngineState.kv_events`)."""
        held = self._held
        try:
            for kind, h in events:
                if kind == 0:  # a clear (and a snapshot after it, on a new link): exact again
                    held.clear()
                    self._reported = True
                elif not self._reported:
                    continue  # (after a garbled feed, until the next clear)
                elif kind == 1:
                    held.add(int(h))
                elif kind == 2:
                    held.discard(h)
        except (TypeError, ValueError) as exc:  # a garbled feed: predict for this replica instead
            log.warning("engine link %s: malformed KV events (%s); routing to it falls back to prediction",
                        self.name, exc)
            held.clear()
            self._reported = False


class EngineLinkReplica(LinkReplica[GenerateRequest, RequestOutput]):
    """A generation engine over the link (`tokenpath engine`, or a Ray actor's: `ray_replica`)."""
