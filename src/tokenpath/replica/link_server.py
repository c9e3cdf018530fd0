"""The engine end of the engine link: one `AsyncEngine` served to its gateway over a socket.

No HTTP, no second gateway, no admission queue: a `GenerateRequest` goes straight into the
engine (which schedules and preempts by its priority) and each `RequestOutput` delta goes
straight back as a frame, with the engine's event times (`protocol.wire`). No task per request:
the engine hands a whole step's outputs to the loop at once (`AsyncEngine.submit`), each is
encoded by its request's `_LinkRequest` callback, and the step's frames leave in one write.

Trust: the first frame must be `hello` carrying the per-launch secret (compared in constant
time), within `HELLO_MAX_BYTES`: a longer one is refused from its length prefix, before its body
is read (the cap was the 64 MiB frame limit, and 8 connections sending 63 MiB each grew an
engine by 554 MiB in a second, issue 23). Anything else is answered `denied` and the connection
closed; refusals are counted (`LinkServer.refused`) and logged at most once per
`REFUSAL_LOG_EVERY_S`, with the count since the last line, so a flood cannot flood the log.
The socket is bound to loopback by its launcher. With `exit_on_close`, the process ends when its
gateway's link closes, so an engine never outlives the gateway that started it.

What every engine kind shares (the handshake, connections, pings, aborts, the state push) is
`LinkEndpoint[E]`; `LinkServer` is the generation kind (`embedding_link.EmbeddingLinkServer` the
encoder's). Frames from the gateway: `Hello`, `Ping` (clock sync), `add` (a `GenerateRequest`),
`Abort`, `Reset`, `StallBound` (its `--stall-timeout`, for `AsyncEngine.step_ceiling_s`). To it:
`Welcome`, `Pong`, `out` (`RequestOutput` deltas), `LinkError` (one request's failure, as a typed error),
`ResetDone`, and the `EngineState` (see `StatePush`); the messages are `protocol.link`'s, encoded
by `protocol.wire`.

State: a changed state reaches the gateway within `STATE_INTERVAL_S`, an unchanged one is repeated
every `STATE_HEARTBEAT_S` (liveness: the gateway marks an engine stalled after `--stall-timeout`,
4 s). Each state says how long the step thread has been in its current step (`step_age_s`), since
the event loop that pushes it goes on while a step hangs (a stuck kernel, a deadlock): the gateway
judges that by the same rule as for an engine in its own process (`replica.liveness`). While the
engine steps, the state rides in the same write as a step's outputs, so it costs neither process a wake-up of its own; an idle engine's timer wakes once per heartbeat, or
at once when a frame arrives. A push on a timer of its own, 10 a second whatever happened, woke both processes for it:
measured 3.5 ms CPU/s in the engine and 2.0 ms/s in the gateway on an idle link (a bare 10 Hz
asyncio timer alone costs 1.4 ms/s here), about as much CPU as framing every output of a
batch-32 decode; 0.5 ms/s and under the 0.5 ms/s resolution of that measurement now.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.errors import RequestFailedError, TokenpathError
from tokenpath.protocol import EngineState, GenerateRequest, RequestOutput
from tokenpath.protocol.link import (
    Abort,
    Denied,
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
from tokenpath.protocol.wire import (
    FrameError,
    OutputFrames,
    decode,
    decode_request,
    encode,
    frame,
    pack,
    read_frame,
)
from tokenpath.replica.liveness import HEARD_EVERY_S, STALL_AFTER_S, hang_bound
from tokenpath.telemetry.engine_spans import EngineSpanRecord, record_engine_trace, will_export

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("tokenpath.engine.link")

STATE_INTERVAL_S = 0.1  # a changed state is pushed at most this long after the change
STATE_HEARTBEAT_S = HEARD_EVERY_S  # an unchanged one is repeated this often (what liveness counts on)
HELLO_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0  # how long `close` lets each connection's handler wind down before cancelling it
HELLO_MAX_BYTES = 4096  # a hello is a secret and a type: ~60 bytes
REFUSAL_LOG_EVERY_S = 60.0


class Outbox:
    """Frames written in one event-loop turn go out in one `send`: a step's deltas for 32 requests
    cost one syscall here and one read on the gateway, not 32 of each."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._buf = bytearray()
        self._scheduled = False
        self.before_flush: Callable[[], None] | None = None  # may `send` more into this write

    def send(self, msg: object) -> None:
        """Queue one message of the link (`protocol.wire.encode` says which are)."""
        self.send_encoded(encode(msg))

    def send_encoded(self, msg: dict) -> None:
        """Queue one message already encoded (a request's output, by its `OutputFrames`)."""
        self._buf += pack(msg)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self.before_flush is not None:
            self.before_flush()  # (still `_scheduled`: what it sends joins this write)
        self._scheduled = False
        if self._buf and not self.writer.is_closing():
            self.writer.write(bytes(self._buf))
        self._buf.clear()

    async def drain(self) -> None:
        with contextlib.suppress(Exception):
            await self.writer.drain()


E = TypeVar("E")


class InFlight(Protocol):
    """One request a connection has in flight: what an `Abort`, or the gateway going away, ends."""

    def cancel(self) -> object: ...


class LinkEndpoint(Generic[E]):
    """The engine end of the link for one kind of engine `E`: the handshake, the connections,
    clock pings, aborts, the stall bound and the state push are the same for every kind. A
    subclass serves its `REQUEST_FRAMES` (`_on_request`) and says what it is (`_info`, `_state`,
    `_reset`): `LinkServer` for an `AsyncEngine`, `embedding_link.EmbeddingLinkServer` for an
    encoder."""

    REQUEST_FRAMES: tuple[str, ...] = ()  # the request frame kinds the subclass serves

    def __init__(self, engine: E, secret: str, exit_on_close: bool = False,
                 tracer_provider: TracerProvider | None = None) -> None:
        if not secret:
            raise ValueError("the engine link needs a secret")
        self.engine = engine
        self.secret = secret.encode()
        self.exit_on_close = exit_on_close
        self.done = asyncio.Event()
        self.tracer_provider = tracer_provider  # the engine's spans, when tracing is on
        self.served = 0  # requests taken on, over every connection (`tokenpath status --ray` shows it)
        self.refused = 0  # connections refused for want of the secret
        self._refusals_logged = 0  # `refused` as of the last log line
        self._refusal_logged_at = float("-inf")
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}  # each handler and its socket
        self._closing = False
        self.stall_after_s = STALL_AFTER_S  # the gateway's, once it says (`StallBound`)

    async def start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_server(self._accept, sock=sock)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection: its handler runs as a task of this server's, not as the task `start_server`
        makes of a coroutine callback. That one's done callback calls `task.exception()`, which
        raises on Python 3.11 when the task was cancelled, so an engine that stopped with a gateway
        still linked (its loop cancels what is left at exit) logged "Exception in callback ...
        CancelledError" from `_handle`. Owning the tasks also lets `close` end them itself."""
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer))
        self._connections[task] = writer
        task.add_done_callback(self._handled)

    def _handled(self, task: asyncio.Task) -> None:
        writer = self._connections.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None:  # (a bug: say so, once)
            log.error("engine link: a connection's handler failed", exc_info=exc)
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        """Stop listening and end every gateway's link: each handler reads its socket's close and
        winds down through its own `finally` (its requests detached from the engine), so nothing
        is left for the loop to cancel when the process exits, and the gateway sees the link close
        at once. A handler still busy after `CLOSE_TIMEOUT_S` is cancelled and awaited."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections.values()):
            writer.close()
        if handlers := list(self._connections):
            _, late = await asyncio.wait(handlers, timeout=CLOSE_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _info(self) -> LinkInfo:
        """What the `Welcome` says about this engine."""
        raise NotImplementedError

    def _state(self) -> EngineState:
        """The engine's state, as pushed to the gateway (a new object per call)."""
        raise NotImplementedError

    def _reset(self) -> int:
        """Forget the engine's prefix cache (`Reset`): the blocks freed."""
        return 0

    def _kv_subscribe(self) -> deque[tuple[int, int]] | None:
        """A KV-event feed for one connection (an engine with a prefix cache), else None."""
        return None

    def _kv_unsubscribe(self, feed: deque[tuple[int, int]]) -> None:
        pass

    def _on_request(self, kind: str, d: dict, outbox: Outbox, live: dict[str, InFlight]) -> None:
        """A request frame of one of `REQUEST_FRAMES`, still encoded: start it, and keep it in
        `live` under its id while it runs (it removes itself when done)."""
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            first = await asyncio.wait_for(read_frame(reader, limit=HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            hello = decode(first) if first["t"] == "hello" else None  # (nothing else is decoded first)
        except (TimeoutError, asyncio.IncompleteReadError, FrameError, OSError):
            hello = None
        secret = hello.secret if isinstance(hello, Hello) else None
        if not isinstance(secret, str) or not hmac.compare_digest(secret.encode(), self.secret):
            if not self._closing:  # (a hello cut short by `close` is no refusal)
                self._refused(peer)
            with contextlib.suppress(Exception):
                writer.write(frame(Denied("the engine link requires its launch secret")))
                await writer.drain()
            writer.close()
            return
        log.info("engine link: gateway connected from %s", peer)
        writer.write(frame(Welcome(time.monotonic(), self._info())))
        outbox = Outbox(writer)
        live: dict[str, InFlight] = {}  # this connection's requests in flight, by id
        feed = self._kv_subscribe()  # this gateway's KV-event feed (its prefix index), if the engine has one
        push = StatePush(self._state if feed is None else lambda: _with_events(self._state(), feed), outbox)
        pusher = asyncio.create_task(self._push_state(push))
        try:
            while True:
                msg = await read_frame(reader)
                kind = msg["t"]
                push.kick()  # (work may follow: back to pushing changes within STATE_INTERVAL_S)
                if kind in self.REQUEST_FRAMES:  # (decoded by the subclass: one that does not decode fails alone)
                    self._on_request(kind, msg.get("req") or {}, outbox, live)
                else:
                    self._on_message(decode(msg), outbox, live)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError) as exc:
            if self._closing:
                log.info("engine link: closed the gateway's link (the engine is stopping)")
            else:
                log.info("engine link: gateway link closed (%s)", type(exc).__name__)
        finally:
            pusher.cancel()
            if feed is not None:
                self._kv_unsubscribe(feed)
            for entry in list(live.values()):  # the gateway is gone: nobody will read these
                entry.cancel()
            live.clear()
            await asyncio.gather(pusher, return_exceptions=True)
            writer.close()
            if self.exit_on_close:
                self.done.set()

    async def _push_state(self, push: StatePush) -> None:
        while True:
            push.on_timer()
            await push.outbox.drain()
            await push.wait()

    def _on_message(self, msg: object, outbox: Outbox, live: dict[str, InFlight]) -> None:
        if isinstance(msg, Ping):
            outbox.send(Pong(msg.id, time.monotonic()))
        elif isinstance(msg, Abort):
            gone = live.pop(str(msg.id), None)
            if gone is not None:
                log.info("request %s aborted by the gateway", msg.id)
                gone.cancel()
        elif isinstance(msg, Reset):  # vLLM's /reset_prefix_cache, for benchmarks that must start cold
            outbox.send(ResetDone(msg.id, self._reset()))
        elif isinstance(msg, StallBound) and isinstance(msg.stall_after_s, int | float) and msg.stall_after_s > 0:
            self.stall_after_s = float(msg.stall_after_s)

    def _refused(self, peer: object) -> None:
        """Count a refused connection; log the first, then one line per interval with the count."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at < REFUSAL_LOG_EVERY_S:
            return
        since = self.refused - self._refusals_logged
        log.warning("engine link: refused %d connection(s) without the launch secret (latest from %s; %d in all); "
                    "next report in %.0fs at most", since, peer, self.refused, REFUSAL_LOG_EVERY_S,
                    extra={"event": "link_refused", "refused": since, "refused_total": self.refused})
        self._refusals_logged, self._refusal_logged_at = self.refused, now


class LinkServer(LinkEndpoint[AsyncEngine]):
    """An `AsyncEngine` served over the link: `add` frames (a `GenerateRequest`) in, `out` frames
    (its `RequestOutput` deltas) back."""

    REQUEST_FRAMES = ("add",)

    def _info(self) -> LinkInfo:
        e = self.engine
        s = e.state()
        return LinkInfo(model=e.model_name, max_model_len=e.max_model_len, block_size=s.block_size,
                        num_blocks=s.num_blocks, max_num_seqs=e.config.max_num_seqs, pid=os.getpid(),
                        engine=e.config)

    def _state(self) -> EngineState:
        s = self.engine.state()  # (a new object per call: ours to fill)
        s.step_stats = self.engine.step_stats.snapshot()
        # What the gateway will judge a hang by: no step past it counts as normal (as in process).
        self.engine.step_ceiling_s = hang_bound(self.stall_after_s, s.step_allowance_s)
        return s

    def _reset(self) -> int:
        return self.engine.reset_prefix_cache()

    def _kv_subscribe(self) -> deque[tuple[int, int]] | None:
        return self.engine.core.blocks.subscribe()

    def _kv_unsubscribe(self, feed: deque[tuple[int, int]]) -> None:
        self.engine.core.blocks.unsubscribe(feed)

    def _on_request(self, kind: str, d: dict, outbox: Outbox, live: dict[str, InFlight]) -> None:
        try:
            request = decode_request(d)
        except TokenpathError as exc:
            outbox.send(LinkError.of(str(d.get("id")), exc))
            return
        except Exception as exc:  # a malformed frame from a trusted peer: this request's problem only
            outbox.send(LinkError.malformed(str(d.get("id")), exc))
            return
        log.info("request %s queued: %d prompt tokens, priority %d, tenant %s, trace %s", request.request_id,
                 len(request.prompt_token_ids), request.priority, request.tenant, request.traceparent or "-")
        entry = _LinkRequest(self, request, outbox, live)
        try:
            self.engine.submit(request, entry)
        except TokenpathError as exc:
            outbox.send(LinkError.of(request.request_id, exc))
            return
        live[request.request_id] = entry
        self.served += 1


def _with_events(state: EngineState, feed: deque[tuple[int, int]]) -> EngineState:
    """The state with the KV events queued since the last one (drained: each goes out once; a
    state carrying events always differs from the last, so it is sent)."""
    events = []
    with contextlib.suppress(IndexError):
        while True:
            kind, h = feed.popleft()
            events.append([kind, h])
    state.kv_events = events
    return state


class StatePush:
    """When a link's `state` frame goes out (module docstring): with a write that is leaving anyway
    once `STATE_INTERVAL_S` has passed since the last one, else from the timer when it changed
    (an engine that just went idle) or the heartbeat is due. The timer ticks every
    `STATE_INTERVAL_S` while there is work, or was a frame from the gateway within the last
    heartbeat; otherwise once per heartbeat, or when `kick`ed."""

    def __init__(self, make: Callable[[], EngineState], outbox: Outbox) -> None:
        self.make, self.outbox = make, outbox
        self.last: EngineState | None = None
        self.sent_at = float("-inf")
        self.kicked_at = float("-inf")
        self._kicked = asyncio.Event()
        outbox.before_flush = self.with_outputs

    def kick(self) -> None:
        self.kicked_at = time.monotonic()
        self._kicked.set()

    async def wait(self) -> None:
        """Until the timer's next tick."""
        busy = self.last is not None and (self.last.running or self.last.waiting)
        if busy or self.last is None or time.monotonic() - self.kicked_at < STATE_HEARTBEAT_S:
            await asyncio.sleep(STATE_INTERVAL_S)
            return
        self._kicked.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kicked.wait(), STATE_HEARTBEAT_S)

    def with_outputs(self) -> None:
        if time.monotonic() - self.sent_at >= STATE_INTERVAL_S:
            self._send_if(changed_only=True)

    def on_timer(self) -> None:
        age = time.monotonic() - self.sent_at
        if age >= STATE_INTERVAL_S:
            self._send_if(changed_only=age < STATE_HEARTBEAT_S)

    def _send_if(self, changed_only: bool) -> None:
        state = self.make()
        if changed_only and state == self.last:
            return
        self.last, self.sent_at = state, time.monotonic()
        self.outbox.send(state)


class _LinkRequest:
    """One request in flight on a link: the engine's sink for it (called on the loop with each
    output, or the exception that ended it), which frames it for the gateway."""

    def __init__(self, server: LinkServer, request: GenerateRequest, outbox: Outbox,
                 live: dict[str, InFlight]) -> None:
        self.server, self.request, self.outbox, self.live = server, request, outbox, live
        self.completion = 0
        # This process exports the request's engine spans (tracing on, a trace to join): the
        # last output says so, and the gateway does not build them a second time.
        self.traced = will_export(server.tracer_provider, request.traceparent)
        self.token_times: list[float] = []  # when choice 0's tokens left, for the decode span's ITL
        self.frames = OutputFrames()  # (its engine events go out only when they change)

    def cancel(self) -> None:
        """Aborted by the gateway, or the gateway is gone: the engine stops it and stops delivering."""
        self.server.engine.detach(self.request.request_id)

    def __call__(self, out: RequestOutput | BaseException) -> None:
        rid = self.request.request_id
        if isinstance(out, BaseException) or out.error is not None:
            self.live.pop(rid, None)
            exc = out if isinstance(out, BaseException) else RequestFailedError(out.error or "")
            if not isinstance(exc, TokenpathError):
                log.error("request %s failed: %r", rid, exc)
            self.outbox.send(LinkError.of(rid, exc))
            return
        if out.finished and self.traced:
            out.events.traced = True
        self.outbox.send_encoded(self.frames.encode(out))
        self.completion += sum(len(c.token_ids) for c in out.outputs)
        if self.traced and any(c.token_ids for c in out.outputs if c.index == 0):
            self.token_times.append(time.monotonic())
        if out.finished:
            self.live.pop(rid, None)
            self.finished(out)

    def finished(self, out: RequestOutput) -> None:
        rid, server = self.request.request_id, self.server
        log.info("request %s finished: %s, %d cached prompt tokens, %d preemptions", rid,
                 ",".join(str(c.finish_reason) for c in out.outputs if c.finish_reason),
                 out.num_cached_tokens, out.num_preemptions)
        ev, params = out.events, self.request.params
        if self.traced:
            record_engine_trace(server.tracer_provider, EngineSpanRecord(
                request_id=rid, model=server.engine.model_name, traceparent=self.request.traceparent,
                operation=self.request.operation, queued=ev.queued, scheduled=ev.scheduled,
                first_token=ev.first_token, finished=ev.finished, prompt_tokens=len(self.request.prompt_token_ids),
                completion_tokens=self.completion, cached_tokens=out.num_cached_tokens,
                preemptions=out.num_preemptions, prefill_chunks=list(ev.prefill_chunks),
                token_times=self.token_times, finish_reasons=[str(c.finish_reason) for c in out.outputs
                                                              if c.finish_reason],
                max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                seed=params.seed))

