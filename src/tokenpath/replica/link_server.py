"""The engine end of the engine link: one `AsyncEngine` served to its gateway over a socket.

No HTTP, no second gateway, no admission queue: a `GenerateRequest` goes straight into the
engine (which schedules and preempts by its priority) and each `RequestOutput` delta goes
straight back as a frame, with the engine's event times (`protocol.wire`). No task per request:
the engine hands a whole step's outputs to the loop at once (`AsyncEngine.submit`), each is
encoded by its request's `_LinkRequest` callback, and the step's frames leave in one write.

Trust: the first frame must be `hello` carrying the per-launch secret (compared in constant
time); anything else is answered `denied` and the connection closed, and the attempt is logged.
The socket is bound to loopback by its launcher. With `exit_on_close`, the process ends when its
gateway's link closes, so an engine never outlives the gateway that started it.

Frames from the gateway: `hello`, `ping` (clock sync), `add`, `abort`. To it: `welcome`, `pong`,
`out`, `err` (one request's failure, as a typed error), `state` (pushed every `STATE_INTERVAL_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time

from tokenpath.engine.async_engine import AsyncEngine
from tokenpath.errors import RequestFailedError, TokenpathError
from tokenpath.protocol import GenerateRequest, RequestOutput
from tokenpath.protocol.wire import FrameError, decode_request, encode_output, pack, read_frame
from tokenpath.telemetry.engine_spans import record_engine_trace

log = logging.getLogger("tokenpath.engine.link")

STATE_INTERVAL_S = 0.1
HELLO_TIMEOUT_S = 5.0


class Outbox:
    """Frames written in one event-loop turn go out in one `send`: a step's deltas for 32 requests
    cost one syscall here and one read on the gateway, not 32 of each."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._buf = bytearray()
        self._scheduled = False

    def send(self, msg: dict) -> None:
        self._buf += pack(msg)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._buf and not self.writer.is_closing():
            self.writer.write(bytes(self._buf))
        self._buf.clear()

    async def drain(self) -> None:
        with contextlib.suppress(Exception):
            await self.writer.drain()


class LinkServer:
    def __init__(self, engine: AsyncEngine, secret: str, exit_on_close: bool = False,
                 tracer_provider: object | None = None) -> None:
        if not secret:
            raise ValueError("the engine link needs a secret")
        self.engine = engine
        self.secret = secret.encode()
        self.exit_on_close = exit_on_close
        self.done = asyncio.Event()
        self.tracer_provider = tracer_provider  # the engine's spans, when tracing is on
        self.served = 0  # requests taken on, over every connection (`tokenpath status --ray` shows it)
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_server(self._handle, sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _info(self) -> dict:
        e = self.engine
        s = e.state()
        return {"model": e.model_name, "max_model_len": e.max_model_len, "block_size": s.block_size,
                "num_blocks": s.num_blocks, "max_num_seqs": e.config.max_num_seqs, "pid": os.getpid()}

    def _state(self) -> dict:
        s = self.engine.state()
        return {"t": "state", "waiting": s.waiting, "running": s.running, "kv": s.kv_usage,
                "healthy": s.healthy, "pq": s.prefix_cache_queries, "ph": s.prefix_cache_hits,
                "pre": s.num_preemptions, "steps": s.steps, "num_blocks": s.num_blocks,
                "block_size": s.block_size, "sh": self.engine.step_stats.snapshot()}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, FrameError, OSError):
            hello = {}
        secret = hello.get("secret") if hello.get("t") == "hello" else None
        if not isinstance(secret, str) or not hmac.compare_digest(secret.encode(), self.secret):
            log.warning("engine link: refused a connection from %s without the launch secret", peer)
            with contextlib.suppress(Exception):
                writer.write(pack({"t": "denied", "message": "the engine link requires its launch secret"}))
                await writer.drain()
            writer.close()
            return
        log.info("engine link: gateway connected from %s", peer)
        writer.write(pack({"t": "welcome", "now": time.monotonic(), "info": self._info()}))
        outbox = Outbox(writer)
        live: dict[str, _LinkRequest] = {}
        tasks: dict[str, asyncio.Task] = {}  # requests of the frame kinds a subclass adds
        pusher = asyncio.create_task(self._push_state(outbox))
        try:
            while True:
                msg = await read_frame(reader)
                kind = msg["t"]
                if kind == "ping":
                    outbox.send({"t": "pong", "id": msg.get("id"), "now": time.monotonic()})
                elif kind == "add":
                    self._add(msg["req"], outbox, live)
                elif kind == "reset":  # vLLM's /reset_prefix_cache, for benchmarks that must start cold
                    freed = self.engine.reset_prefix_cache()
                    outbox.send({"t": "reset_done", "id": msg.get("id"), "freed": freed})
                elif kind == "abort":
                    gone = live.pop(str(msg.get("id")), None)
                    if gone is not None:
                        log.info("request %s aborted by the gateway", gone.request.request_id)
                        self.engine.detach(gone.request.request_id)
                    task = tasks.pop(str(msg.get("id")), None)
                    if task is not None:
                        task.cancel()  # a subclass's request (an embedding batch member)
                else:
                    self._on_frame(kind, msg, outbox, tasks)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError) as exc:
            log.info("engine link: gateway link closed (%s)", type(exc).__name__)
        finally:
            pusher.cancel()
            for rid in list(live):  # the gateway is gone: nobody will read these
                self.engine.detach(rid)
            live.clear()
            for task in list(tasks.values()):
                task.cancel()
            await asyncio.gather(pusher, return_exceptions=True)
            writer.close()
            if self.exit_on_close:
                self.done.set()

    def _on_frame(self, kind: str, msg: dict, outbox: Outbox, tasks: dict[str, asyncio.Task]) -> None:
        """A frame kind this class does not know; subclasses add theirs (`embedding_link.py`)."""

    def _add(self, d: dict, outbox: Outbox, live: dict[str, _LinkRequest]) -> None:
        try:
            request = decode_request(d)
        except TokenpathError as exc:
            outbox.send(_error(str(d.get("id")), exc))
            return
        except Exception as exc:  # a malformed frame from a trusted peer: this request's problem only
            outbox.send({"t": "err", "id": str(d.get("id")), "status": 400,
                         "message": f"malformed request: {exc}", "type": "invalid_request_error"})
            return
        log.info("request %s queued: %d prompt tokens, priority %d, tenant %s, trace %s", request.request_id,
                 len(request.prompt_token_ids), request.priority, request.tenant, request.traceparent or "-")
        entry = _LinkRequest(self, request, outbox, live)
        try:
            self.engine.submit(request, entry)
        except TokenpathError as exc:
            outbox.send(_error(request.request_id, exc))
            return
        live[request.request_id] = entry
        self.served += 1

    async def _push_state(self, outbox: Outbox) -> None:
        while True:
            outbox.send(self._state())
            await outbox.drain()
            await asyncio.sleep(STATE_INTERVAL_S)


class _LinkRequest:
    """One request in flight on a link: the engine's sink for it (called on the loop with each
    output, or the exception that ended it), which frames it for the gateway."""

    def __init__(self, server: LinkServer, request: GenerateRequest, outbox: Outbox,
                 live: dict[str, _LinkRequest]) -> None:
        self.server, self.request, self.outbox, self.live = server, request, outbox, live
        self.completion = 0

    def __call__(self, out: RequestOutput | BaseException) -> None:
        rid = self.request.request_id
        if isinstance(out, BaseException) or out.error is not None:
            self.live.pop(rid, None)
            exc = out if isinstance(out, BaseException) else RequestFailedError(out.error or "")
            if isinstance(exc, TokenpathError):
                self.outbox.send(_error(rid, exc))
            else:
                log.error("request %s failed: %r", rid, exc)
                self.outbox.send({"t": "err", "id": rid, "status": 503, "type": "service_unavailable",
                                  "message": f"{type(exc).__name__}: {exc}"})
            return
        self.outbox.send(encode_output(out))
        self.completion += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self.live.pop(rid, None)
            self.finished(out)

    def finished(self, out: RequestOutput) -> None:
        rid, server = self.request.request_id, self.server
        log.info("request %s finished: %s, %d cached prompt tokens, %d preemptions", rid,
                 ",".join(str(c.finish_reason) for c in out.outputs if c.finish_reason),
                 out.num_cached_tokens, out.num_preemptions)
        ev = out.events
        record_engine_trace(server.tracer_provider, traceparent=self.request.traceparent,  # type: ignore[arg-type]
                            request_id=rid, model=server.engine.model_name, queued=ev.queued,
                            scheduled=ev.scheduled, first_token=ev.first_token, finished=ev.finished,
                            prompt_tokens=len(self.request.prompt_token_ids), completion_tokens=self.completion,
                            cached_tokens=out.num_cached_tokens, preemptions=out.num_preemptions)


def _error(rid: str, exc: TokenpathError) -> dict:
    return {"t": "err", "id": rid, "status": exc.status_code, "type": exc.error_type, "message": exc.message,
            "param": exc.param, "code": exc.code, "cls": type(exc).__name__}
