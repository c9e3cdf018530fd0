"""The asyncio front of the engine: `generate` streams deltas, `abort` removes a request.

The step loop runs in one background thread (torch releases the GIL inside its kernels), so an
HTTP server on the event loop stays responsive while the model computes. Requests and aborts
cross into the thread through a queue and are applied between steps: an abort takes effect
before the next step, and its blocks are free by then. Outputs cross back with
`call_soon_threadsafe` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

from tokenpath.config import EngineConfig
from tokenpath.engine.core import EngineCore
from tokenpath.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tokenpath.protocol import GenerateRequest
from tokenpath.protocol.outputs import EngineState, RequestOutput

log = logging.getLogger("tokenpath.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **engine_kwargs: object) -> None:
        self.config = config or EngineConfig(**engine_kwargs)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.model_name
        self.max_model_len = self.core.max_model_len
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenpath-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ------------------------------------------------------------ public API
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield deltas until the request finishes. Closing the iterator aborts the request.
        `request.arrival` is taken as this process's clock (set it where the request arrived)."""
        request_id = request.request_id
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"the engine for '{self.model_name}' is not running")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        # Validated at the edge; a request this engine could never run fails in `add_request`,
        # and that error reaches this stream like any other.
        self._send(("add", replace(request, timeline=None)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:  # the engine already ended it and freed its blocks
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def state(self) -> EngineState:
        state = self.core.state()
        state.healthy = self.healthy
        return state

    # ------------------------------------------------------------ the loop thread
    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.core.has_work():
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as exc:  # the engine is dead: fail every request, loudly
            log.exception("engine step loop died", extra={"event": "engine_died", "model": self.model_name})
            self.error = exc
            dead = EngineDeadError(f"the engine for '{self.model_name}' failed: {type(exc).__name__}: {exc}")
            for rid in list(self._streams):
                self._deliver(rid, dead)

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                request = msg[1]
                try:
                    self.core.add_request(request)
                except Exception as exc:  # (cannot fit this engine, or a duplicate id): this request's problem only
                    self._deliver(request.request_id, exc)
            elif msg[0] == "abort":
                out = self.core.abort(msg[1])
                if out is not None:
                    self._deliver(msg[1], out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)
