"""The asyncio front of the engine: `generate` streams deltas, `abort` removes a request.

The step loop runs in one background thread (torch releases the GIL inside its kernels), so an
HTTP server on the event loop stays responsive while the model computes. Requests and aborts
cross into the thread through a queue and are applied between steps: an abort takes effect
before the next step, and its blocks are free by then. A step's outputs cross back in one
`call_soon_threadsafe` (one wake-up of the loop per step, not one per request) and are handed to
each request's sink: its asyncio queue (`generate`), or a callback (`submit`, for the engine link,
which serves every request of a step from one place instead of one task per request).

Whoever watches the engine's liveness (`replica.liveness`: through `replica.local` in this
process, from each state push over the engine link otherwise) reads `step_beat()`: how long the
step thread has been in its current turn of the loop (`beat`: when the turn began; 0 while it
waits for work). A step that never returns (a native call stuck, a lock never released) leaves it
growing while the event loop stays free (the kernels and torch release the GIL), so a hung step
is noticed and its requests released instead of waiting for as long as it hangs.
`step_allowance_s` is how long a normal step of this engine may take, for the step running now:
the longest step so far, or its tokens at the costliest per-token price of a big step
(>= `BIG_STEP_TOKENS`; before one, the first step's, which pays one-time setup too and so errs
long), so a big model's long prefill chunk is not taken for a hang.
Both leave out the time the step thread (and the event loop's, whose GIL it waits for) waited for
a CPU (`engine.cpu_wait`): a step slowed by an oversubscribed machine is running, not hung (a
blocked step waits in no run queue, so a hang is judged as before).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from tokenpath.config import EngineConfig
from tokenpath.engine.core import EngineCore
from tokenpath.engine.cpu_wait import RunQueueWait
from tokenpath.engine.structured.grammar import lower_priority
from tokenpath.errors import DuplicateRequestIdError, EngineDeadError, RequestFailedError
from tokenpath.protocol import GenerateRequest
from tokenpath.protocol.outputs import EngineState, RequestOutput
from tokenpath.telemetry.engine_steps import StepStats

log = logging.getLogger("tokenpath.engine")

Sink = Callable[[RequestOutput | BaseException], None]
BIG_STEP_TOKENS = 64  # a step this big prices a token for `step_allowance_s`


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **engine_kwargs: object) -> None:
        self.config = config or EngineConfig.coerce(engine_kwargs)
        self.core = EngineCore(self.config)
        self.core.loras.wake = self._wake_up  # an adapter loaded off the loop: schedule again
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.model_name
        self.max_model_len = self.core.max_model_len
        # Step time and batch size, counted here whichever process runs the engine; the gateway
        # reads them directly in-process and from the link's state frames otherwise.
        self.step_stats = StepStats()
        self.core.step_observers.append(self.step_stats.observe)
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Sink] = {}  # request id -> where its outputs go, on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compiling: dict[str, bool] = {}  # requests whose grammar compiles off the step thread: aborted?
        # Those compiles run on threads below the step thread's priority (grammar.lower_priority):
        # one request's compile takes only what the step leaves of the cores.
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="tokenpath-compile", initializer=lower_priority,
                                            initargs=(True,))
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stepped = False  # a step ran since the step buffers were last released (core.release_step_buffers)
        self.error: BaseException | None = None
        self.beat = time.monotonic()  # the step thread's last turn of its loop (see the module doc)
        self.idle = True  # the step thread waits for work (no step runs, none can hang)
        self._cpu_wait = RunQueueWait()  # the step and loop threads' run-queue wait (each attaches itself)
        self._beat_wait: tuple[float, float | None] = (self.beat, None)  # (beat, that wait when it began)
        # Of steps that ended within `step_ceiling_s`: the first one's price per token, then the
        # longest step and the costliest token of a big step among the later ones.
        self.first_step_s_per_token = 0.0
        self.longest_step_s = 0.0
        self.step_s_per_token = 0.0
        # Steps longer than this are not counted: the watcher sets it to its stall bound, so one
        # hang that ended does not stretch the bound for every later one.
        self.step_ceiling_s = math.inf

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._cpu_wait.attach()  # the loop's thread: it holds the GIL the step thread waits for
        self._thread = threading.Thread(target=self._run, name="tokenpath-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread, waiting up to `timeout` for its current step (a hung one is left
        behind: the thread is a daemon, and exits with the process)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if not self._thread.is_alive():  # (a hung thread's watcher may still read it)
                self._cpu_wait.close()
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.core.loras.close()

    # ------------------------------------------------------------ public API
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield deltas until the request finishes. Closing the iterator aborts the request.
        `request.arrival` is taken as this process's clock (set it where the request arrived)."""
        request_id = request.request_id
        stream: asyncio.Queue = asyncio.Queue()
        self.submit(request, stream.put_nowait)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, DuplicateRequestIdError):  # the core refused it: nothing to abort
                    finished = True  # (an abort would stop the other request that holds the id)
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

    def submit(self, request: GenerateRequest, sink: Sink) -> None:
        """Queue a request whose outputs (and a final exception, if the engine dies) are passed to
        `sink` on the event loop, in order. Raises at once only if the engine is dead or the id is in
        use; a request this engine could never run fails through the sink. A finished output
        (`finished`, or one with `error` set) is the last; `detach` ends it earlier."""
        request_id = request.request_id
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"the engine for '{self.model_name}' is not running")
        if request_id in self._streams:
            raise DuplicateRequestIdError(f"request id '{request_id}' is already in use")
        self._streams[request_id] = sink
        # Validated at the edge; a request this engine could never run fails in `add_request`,
        # and that error reaches the sink like any other. The request holds nothing of the
        # gateway's (that stays in its `Submission`), so the step thread gets it as it is.
        spec = request.params.structured
        if spec is not None and self._loop is not None and not self.core.tokenizer.grammar_cached(spec):
            # A grammar not compiled here yet (an engine process: the gateway compiled it in its
            # own) is compiled on a worker thread, which llguidance lets run beside the step thread
            # (it releases the GIL), and the request queued once it is: the step loop never waits
            # for one request's compile (up to the API's 5 s bound), so every other stream goes on.
            grammars = self.core.tokenizer
            self._compiling[request_id] = False
            fut = self._loop.run_in_executor(self._compiler, lambda: grammars.grammars.get(spec))
            fut.add_done_callback(lambda done: self._compiled(request, done))
            return
        self._send(("add", request))

    def _compiled(self, request: GenerateRequest, done: asyncio.Future) -> None:
        """On the loop: a request's grammar is compiled (and cached: `add_request` gets a copy), so
        it goes to the step thread now; a compile error fails it alone. One aborted meanwhile is
        still added, then aborted, in that order on the step thread: its stream ends as any abort's."""
        aborted = self._compiling.pop(request.request_id, False)
        exc = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if exc is not None:
            sink = self._streams.pop(request.request_id, None)
            if sink is not None:
                sink(exc)
            return
        if request.request_id in self._streams:
            self._send(("add", request))
            if aborted:
                self._send(("abort", request.request_id))

    def detach(self, request_id: str) -> None:
        """Stop delivering to a submitted request's sink and abort it in the engine."""
        if self._streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        if request_id in self._compiling:  # not on the step thread yet: aborted once it is
            self._compiling[request_id] = True
        self._send(("abort", request_id))

    def fail(self, request_id: str, exc: BaseException) -> None:
        """On the loop: end a request's stream with `exc` now, without waiting for the step thread
        (a watcher found it hung). Its `generate` raises `exc` and sends the abort, which the step
        thread applies whenever it comes back."""
        self._deliver_step([(request_id, exc)])

    def step_allowance_s(self) -> float:
        """How long a normal step of this engine may take, for the step running now (or the last)."""
        price = self.step_s_per_token or self.first_step_s_per_token
        return max(self.longest_step_s, price * self.core.step_tokens)

    def step_beat(self, now: float | None = None) -> tuple[float, float | None]:
        """For the engine's watcher: how long the step thread has been in its current turn of the
        loop, less the time it waited for a CPU meanwhile (0 while it waits for work), and `step_allowance_s` (None before a first step has
        ended: that one pays one-time setup, and there is no price yet)."""
        if self.idle:
            return 0.0, self.step_allowance_s() if self.first_step_s_per_token else None
        age = (time.monotonic() if now is None else now) - self.beat
        beat, wait0 = self._beat_wait
        if beat == self.beat and wait0 is not None and (wait := self._cpu_wait.read()) is not None:
            age -= wait - wait0  # (waiting for a CPU is not hanging: see the module doc)
        age = max(0.0, age)
        return age, self.step_allowance_s() if self.first_step_s_per_token else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's /reset_prefix_cache); blocks forgotten. Safe from the
        loop while the step thread runs (see `BlockManager.reset_prefix_cache`)."""
        return self.core.blocks.reset_prefix_cache()

    def state(self) -> EngineState:
        state = self.core.state()
        state.healthy = self.healthy
        state.step_age_s, state.step_allowance_s = self.step_beat()
        return state

    # ------------------------------------------------------------ the loop thread
    def _wake_up(self) -> None:
        self._wake.set()

    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _run(self) -> None:
        try:
            self._cpu_wait.attach()
            while not self._stopping:
                wait0 = self._cpu_wait.read()
                self.beat = started = time.monotonic()
                self._beat_wait = (started, wait0)
                self.idle = False
                self._drain_inbox()
                if self.core.has_work():
                    outs = self.core.step()
                    self._stepped = True
                    took = time.monotonic() - started
                    if wait0 is not None and (wait := self._cpu_wait.read()) is not None:
                        took -= wait - wait0  # (priced as the hang is judged: without the run-queue wait)
                    if took <= self.step_ceiling_s and (tokens := self.core.step_tokens):
                        if not self.first_step_s_per_token:
                            self.first_step_s_per_token = took / tokens
                        else:
                            self.longest_step_s = max(self.longest_step_s, took)
                            if tokens >= BIG_STEP_TOKENS:
                                self.step_s_per_token = max(self.step_s_per_token, took / tokens)
                    if outs and self._loop is not None:
                        self._loop.call_soon_threadsafe(self._deliver_step, outs)
                    while self.core.rejected:  # (their adapter failed to load)
                        rid, exc = self.core.rejected.pop()
                        self._deliver(rid, exc)
                    if not self.core.last_scheduled:  # only requests waiting for an adapter: no spinning
                        self.idle = True
                        self._wake.wait(timeout=0.05)
                        self._wake.clear()
                else:
                    self.idle = True
                    if self._stepped:  # just went idle: the burst's step buffers go back to the OS
                        self._stepped = False
                        self.core.release_step_buffers()
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
        """One item from the step thread (an add that failed, an abort's final output, death)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver_step, [(request_id, item)])

    def _deliver_step(self, items: list) -> None:
        """On the loop: each output (or `(request id, item)`) to its request's sink. A sink that
        raises loses its request, never the others' outputs."""
        for item in items:
            rid, item = item if isinstance(item, tuple) else (item.request_id, item)
            sink = self._streams.get(rid)
            if sink is None:
                continue
            if isinstance(item, BaseException) or item.finished or item.error is not None:
                del self._streams[rid]  # its last item: nothing more will come for it
            try:
                sink(item)
            except Exception:
                log.exception("delivering an output of request %s failed", rid)
