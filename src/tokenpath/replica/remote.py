"""A replica behind an OpenAI-compatible HTTP endpoint: vLLM, SGLang, llama.cpp, another gateway
or another `tokenpath serve` (tokenpath's own engine processes use the engine link instead).

Generation is one streaming `POST /v1/completions` with the prompt as token ids (so the gateway's
tokenization, and hence its prefix hashes, are the ones the engine sees). Closing the stream
closes the HTTP response; the server sees the disconnect and aborts the request, which is how
vLLM and tokenpath both treat a vanished client.

State comes from polling the server's Prometheus `/metrics` (the wanted samples read in one regex
pass, `parse_metrics`): `tokenpath:` and `vllm:` series have the same meanings, and SGLang's and llama.cpp's are
mapped onto them. A llama-server without `--metrics` (its /metrics answers 501) is read from its
`/slots` (slots busy, their tokens against their context). A server with neither is probed on
`/health` for liveness only. Failed polls mark the replica unhealthy, which ejects it from
routing until a poll succeeds again. An idle backend's /metrics is read less often than its
/health (`idle_metrics_s`: the page is the expensive one to render). Figures older than
`stale_after_s` (polls failing or lagging, not yet enough to eject) count as saturated, as llm-d's saturation detector treats stale
metrics: the least-loaded pick and admission's drain estimate do not trust a number that may
have been overtaken.

A server that stops answering altogether (frozen, paused, cut off) is a stall, as for an engine
process (`replica.liveness`): nothing heard for the stall bound (no successful poll, no chunk on
any stream) and its in-flight streams are closed, each with `ReplicaStalledError` (retried
elsewhere before the first token); the per-request progress bounds hold here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

import httpx

from tokenpath.errors import InvalidRequestError, RequestFailedError, ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, ReplicaState
from tokenpath.protocol.openai_wire import cached_tokens, completion_body, completion_logprobs, prompt_payload
from tokenpath.protocol.outputs import CompletionOutput, EngineEvents, RequestOutput
from tokenpath.protocol.submission import Submission
from tokenpath.replica.backend_timing import BackendTiming, apply_timing, backend_timing
from tokenpath.replica.base import ReplicaBusyError
from tokenpath.replica.http1 import Http1Error, Http1Pool, Http1Response, lean_applies
from tokenpath.replica.kv_events import KVEventFeed, KVEventIndex
from tokenpath.replica.liveness import Liveness
from tokenpath.replica.polled import PolledState

# Series (family names as prometheus_client reports them) -> ReplicaState field.
_WAITING = ("tokenpath:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
            "llamacpp:requests_deferred")
_RUNNING = ("tokenpath:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
            "llamacpp:requests_processing")
_KV = ("tokenpath:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
       "sglang:token_usage", "llamacpp:kv_cache_usage_ratio")
_CACHE_INFO = ("tokenpath:cache_config_info", "vllm:cache_config_info")
DRAIN_S = 0.05  # the longest a stream's end is waited for after its `[DONE]` (`_drain`)
# A server's whole /metrics page is tens of KB (vLLM's: 58 KB, every histogram bucket), polled
# several times a second per replica on the gateway's event loop. prometheus_client's parser took
# ~8 ms over it, and still 1.5 ms over the wanted lines cut out first (two busy cores, load ~6).
# The samples read here are a handful of plain lines (`name{labels} value`), so one regex pass
# takes them directly: 0.17 ms over vLLM's page at that load. A name is matched whole (not
# `vllm:num_requests_waiting_by_reason` for `vllm:num_requests_waiting`); HELP/TYPE lines and every
# other series are skipped unread. A line start is matched as "\n" (the page read with one
# prepended): a literal first character lets the regex engine jump from line to line, where `^`
# with re.M was tried at every position (0.6-1 ms).
_SAMPLE = re.compile(r"\n(" + "|".join(re.escape(n) for n in (*_WAITING, *_RUNNING, *_KV, *_CACHE_INFO))
                     + r")(?:\{([^\n]*)\})?[ \t]+([^ \t\r\n]+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
# The generation's body encoder, made once (`json.dumps` with arguments builds one per call).
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def _label_value(raw: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], raw) if "\\" in raw else raw


def parse_slots(slots: object, name: str) -> ReplicaState:
    """llama-server's `GET /slots` -> ReplicaState: the busy slots run, the slot count is the batch,
    and KV usage is the busy slots' tokens (prompt and decoded) over all slots' context. It
    reports no queue (a request waits for a free slot unseen), so `waiting` stays 0."""
    if not isinstance(slots, list) or not all(isinstance(x, dict) for x in slots):
        raise ValueError("/slots: expected a list of slot objects")
    busy = [x for x in slots if x.get("is_processing")]
    ctx = sum(int(x.get("n_ctx") or 0) for x in slots)
    used = sum(int(x.get("n_prompt_tokens") or 0) + sum(int(t.get("n_decoded") or 0) for t in x.get("next_token") or ())
               for x in busy)
    return ReplicaState(name=name, running=len(busy), max_num_seqs=len(slots),
                        kv_usage=min(1.0, used / ctx) if ctx else 0.0)


def parse_metrics(text: str, name: str) -> ReplicaState:
    """Prometheus exposition text -> ReplicaState (sums across label sets, e.g. several engines).
    A sample whose value is not a number is skipped, as a series the server does not send."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for series, labels, raw in _SAMPLE.findall("\n" + text):
        if series in _CACHE_INFO:
            info.update((k, _label_value(v)) for k, v in _LABEL.findall(labels))
            continue
        with contextlib.suppress(ValueError):
            values[series] = values.get(series, 0.0) + float(raw)
    first = lambda names: next((values[n] for n in names if n in values), 0.0)  # noqa: E731
    state = ReplicaState(name=name, waiting=int(first(_WAITING)), running=int(first(_RUNNING)),
                         kv_usage=min(1.0, max(0.0, first(_KV))))
    with contextlib.suppress(KeyError, ValueError):
        state.block_size = int(info["block_size"])
    for key in ("num_gpu_blocks", "num_blocks"):
        with contextlib.suppress(KeyError, ValueError):
            state.num_blocks = int(float(info[key]))
    return state


@dataclass
class RemoteReplicaConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8001
    model: str | None = None  # the model name the server knows; default: the deployment's name
    api_key: str | None = None
    poll_interval_s: float = 0.25
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    max_num_seqs: int = 0  # not exported by vLLM; set it so admission knows the batch size
    block_size: int | None = None  # overrides what /metrics reports
    unhealthy_after: int = 2  # consecutive failed polls
    headers: dict[str, str] = field(default_factory=dict)
    kv_events: str | None = None  # vLLM's KV-event publisher (ZMQ), for the prefix index
    kv_events_replay: str | None = None  # and its replay endpoint (the past, after a gateway restart)
    stale_after_s: float = 1.0  # load figures older than this count as saturated (module docstring)
    # /metrics while the backend is idle (no stream of ours open, and its last figures had nothing
    # running or waiting) is read at most this often; None: half of `stale_after_s`, so the figures
    # never go stale between reads. /health is still asked every poll (liveness, the stall bound).
    # vLLM renders its whole page (~58 KB, every histogram) per GET: ~5 ms of its API server's CPU,
    # 4 times a second per polling gateway, on the cores its requests need (issue 37).
    idle_metrics_s: float | None = None

    def __post_init__(self) -> None:
        # Figures polled less often than they go stale would read as saturated between every two
        # polls: a replica that nothing is ever routed to, with no error saying why.
        if self.stale_after_s <= self.poll_interval_s:
            raise ValueError(f"stale_after_s ({self.stale_after_s}) must be above poll_interval_s "
                             f"({self.poll_interval_s}): figures would be stale between polls")


class RemoteReplica(PolledState):
    config: RemoteReplicaConfig

    def __init__(self, name: str, config: RemoteReplicaConfig, model: str | None = None) -> None:
        self.name = name
        self.config = config
        self.model = config.model or model or name
        self._discover_model = not (config.model or model)
        self.tokenizer: object | None = None  # the deployment's tokenizer, set by whoever builds it
        self.max_model_len: int | None = None
        self.base = config.url.rstrip("/")
        headers = dict(config.headers)
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        # Idle connections are dropped after 4 s, before a uvicorn server's default keep-alive of
        # 5 s (vLLM's, SGLang's) closes them: at equal timeouts a request sent as the server closes
        # fails with a connection error, which would eject a healthy replica.
        self._client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                             keepalive_expiry=4.0))
        # The generate call's own client where it applies (`replica.http1`: ~4 ms less added TTFT),
        # and the polls' (their own connections, each whole poll bounded by the connect timeout).
        lean = lean_applies(self.base)
        self._lean = (Http1Pool(self.base, headers, config.connect_timeout_s, config.read_timeout_s, keepalive_s=4.0)
                      if lean else None)
        self._lean_poll = (Http1Pool(self.base, headers, config.connect_timeout_s, config.connect_timeout_s,
                                     keepalive_s=4.0, max_idle=2) if lean else None)
        self._state = ReplicaState(name=name, healthy=False, detail="not polled yet",
                                   max_num_seqs=config.max_num_seqs, block_size=config.block_size or 16)
        self._poll_failures = 0
        self._has_metrics = True
        self._has_slots = True  # (llama-server's /slots, read where /metrics is off)
        self._polled_at: float | None = None  # monotonic time of the last poll that answered
        self._poller: asyncio.Task | None = None
        self._open: dict[str, httpx.Response | Http1Response] = {}
        self.liveness = Liveness(name)
        self._released: dict[str, BaseException] = {}  # streams liveness let go of, and why
        # The task a stream is awaiting the server in (absent while it is parked at a `yield`,
        # where a cancel would hit its consumer instead): what `_release` interrupts.
        self._readers: dict[str, asyncio.Task | None] = {}  # (None only outside a task: never under asyncio)
        self.kv_index: KVEventIndex | None = None
        self._kv_feed: KVEventFeed | None = None
        if config.kv_events:
            self.kv_index = KVEventIndex(name)
            self._kv_feed = KVEventFeed(self.kv_index, config.kv_events, config.kv_events_replay)

    # -- state ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Poll once (so the first routing decision has real state), then keep polling. Learn the
        served model name (and its context length, where the server says) from /v1/models."""
        with contextlib.suppress(Exception):
            r = await self._client.get("/v1/models", timeout=self.config.connect_timeout_s)
            first = r.json()["data"][0]
            if self._discover_model:
                self.model = first["id"]
            self.max_model_len = first.get("max_model_len")
        if self._kv_feed is not None:
            self._kv_feed.start()
        await self.poll()
        self._ensure_poller()
        self.liveness.start()

    def state(self) -> ReplicaState:
        state = super().state()
        if self.kv_index is not None:  # the backend's own cache, from its KV events (the live set, no copy)
            state.prefix_hashes, state.prefix_reported = self.kv_index.held, self.kv_index.reported
        detail = self.liveness.detail()
        if detail is not None:
            return replace(state, healthy=False, detail=detail)
        age = None if self._polled_at is None else time.monotonic() - self._polled_at
        if state.healthy and age is not None and age > self.config.stale_after_s:
            return replace(state, kv_usage=1.0, waiting=state.waiting + max(state.max_num_seqs, 1),
                           detail=f"load figures {age:.1f} s old: counted as saturated")
        return state

    def _release(self, request_id: str, exc: BaseException) -> None:
        """Liveness gave up on a stream: interrupt the read it waits in (before the response or in
        its body), so that its reader ends with `exc` (the cancel is taken back in `generate`)."""
        self._released[request_id] = exc
        task = self._readers.get(request_id)
        if task is not None and not task.done():
            task.cancel()

    async def poll(self) -> ReplicaState:
        try:
            # The server's own liveness first: vLLM, SGLang and llama.cpp answer /health 503 (or
            # not at all) when their engine died, while /metrics may still be served.
            health = await self._get("/health")
            if health.status_code not in (200, 404):  # (404: a server without a health endpoint)
                self._poll_failures = self.config.unhealthy_after
                self._state.healthy = False
                self._state.detail = f"/health answered {health.status_code}"
                return self._state
            if self._has_metrics and self._idle_figures_fresh():
                self._heard()  # (alive, and its idle figures still fresh: the page is not asked again)
                return self._state
            if self._has_metrics:
                r = await self._optional("/metrics")  # (501: llama-server without --metrics)
                self._has_metrics = r is not None
                if r is not None:
                    self._set(parse_metrics(r.text, self.name))
                    return self._state
            if self._has_slots:
                r = await self._optional("/slots")  # (not llama-server, or started with --no-slots)
                self._has_slots = r is not None
                if r is not None:
                    self._set(parse_slots(r.json(), self.name))
                    return self._state
            self._set(ReplicaState(name=self.name, running=len(self._open)))
        except Exception as exc:  # any failure to reach it counts against its health
            self._poll_failures += 1
            if self._poll_failures >= self.config.unhealthy_after:
                self._state.healthy = False
                self._state.detail = f"poll failed: {type(exc).__name__}: {exc}"
        return self._state

    async def _get(self, path: str) -> httpx.Response | Http1Response:
        if self._lean_poll is not None:
            async with asyncio.timeout(self.config.connect_timeout_s):  # (the whole poll, as httpx's timeout)
                return await self._lean_poll.get(path)
        return await self._client.get(path, timeout=self.config.connect_timeout_s)

    async def _optional(self, path: str) -> httpx.Response | Http1Response | None:
        """GET an endpoint the server may not have: None when it answers 404 or 501 (so it is not
        asked again), the response when it answers, an error for any other failure."""
        r = await self._get(path)
        if r.status_code in (404, 501):
            return None
        if r.status_code >= 400:
            raise Http1Error(f"{path} answered {r.status_code}")
        return r

    def _yield_point(self, rid: str) -> None:
        self._readers.pop(rid, None)

    def _resumed(self, rid: str) -> asyncio.Task | None:
        """Back from a `yield`: raise what liveness released the stream with meanwhile, else note
        the task it now runs in (its consumer's; after a `wait_for` it may be another one)."""
        if rid in self._released:
            raise self._released[rid]
        task = self._readers[rid] = asyncio.current_task()
        return task

    def _idle_figures_fresh(self) -> bool:
        """The last figures said idle, nothing of ours is open there, and they are younger than
        `idle_metrics_s`: a new read would say the same, unless another client's requests arrived
        meanwhile (seen at the next read, within that bound). Busy, every poll reads the page."""
        s, at = self._state, self._polled_at
        if at is None or self._open or not s.healthy or s.running or s.waiting:
            return False
        every = self.config.idle_metrics_s
        return time.monotonic() - at < (self.config.stale_after_s / 2 if every is None else every)

    def _heard(self) -> None:
        """A poll answered: the replica is alive (its failures forgotten), whatever it was asked."""
        self._poll_failures = 0
        self.liveness.heard(time.monotonic())

    def _set(self, state: ReplicaState) -> None:
        self._poll_failures = 0
        self._polled_at = time.monotonic()
        self.liveness.heard(self._polled_at)
        state.max_num_seqs = self.config.max_num_seqs or state.max_num_seqs
        if self.config.block_size:
            state.block_size = self.config.block_size
        self._state = state

    async def close(self) -> None:
        if self._kv_feed is not None:
            await self._kv_feed.close()
        await self.liveness.stop()
        await self._stop_polling()
        await self._client.aclose()
        for pool in (self._lean, self._lean_poll):
            if pool is not None:
                await pool.aclose()

    # -- generation ------------------------------------------------------------------------------
    def _body(self, submission: Submission[GenerateRequest]) -> dict:
        """The completions request (`protocol.openai_wire`: every field sent, carried another way
        or refused by name), with the gateway's session id as OpenAI's `user` (a server that
        routes or accounts by user sees ours)."""
        return completion_body(submission.request, self.model, self.name, submission.session_id)

    async def generate(self, submission: Submission[GenerateRequest]) -> AsyncGenerator[RequestOutput, None]:
        request, timeline = submission.request, submission.timeline
        events = EngineEvents(queued=time.monotonic())  # receipt times: an OpenAI server sends none
        headers = {"X-Request-Id": request.request_id}
        if timeline.attrs.get("traceparent"):  # the replica (vLLM, tokenpath) continues our trace
            headers["traceparent"] = str(timeline.attrs["traceparent"])
        finished: set[int] = set()
        rid = request.request_id
        progress = self.liveness.track(rid, lambda exc: self._release(rid, exc))
        reader = self._readers[rid] = asyncio.current_task()
        try:
            async with self._stream(self._body(submission), headers) as resp:
                # (the lean client's write time; on httpx, which writes inside, the headers' arrival)
                timeline.stamp("sent", at=getattr(resp, "sent_at", None))
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _http_error(self.name, resp)
                self._open[request.request_id] = resp
                last: RequestOutput | None = None  # held back until the usage chunk (cached tokens)
                timing: BackendTiming | None = None  # the backend's own stage times, where it reports them
                async for data in _sse_data(resp):
                    now = time.monotonic()
                    self.liveness.heard(now)
                    progress.advance(now)
                    if data.get("usage"):  # the usage chunk: where every dialect puts its timings, once
                        timing = backend_timing(data) or timing
                        if last is not None:
                            last.num_cached_tokens = cached_tokens(data) or last.num_cached_tokens
                    out = self._to_output(request, data, events, finished, submission.prompt)
                    if out is None:
                        continue
                    if out.finished:
                        last = out
                    else:
                        self._yield_point(rid)
                        reader = None
                        yield out
                        reader = self._resumed(rid)
                if last is not None:
                    apply_timing(last, timing, timeline)
                    self._yield_point(rid)
                    reader = None
                    yield last
        except asyncio.CancelledError:
            if rid in self._released and reader is not None and reader.uncancel() == 0:
                raise self._released[rid] from None  # our own cancel: the stall, not the caller
            raise
        except Exception as exc:
            if rid in self._released:
                raise self._released[rid] from exc
            if not isinstance(exc, httpx.HTTPError | Http1Error):
                raise
            if request.request_id not in self._open and not finished:
                raise ServiceUnavailableError(f"replica '{self.name}' unreachable: {exc}") from exc
            raise ServiceUnavailableError(f"replica '{self.name}' dropped the stream: {exc}") from exc
        finally:
            self._open.pop(rid, None)
            self._readers.pop(rid, None)
            self.liveness.untrack(rid)
            released = self._released.pop(rid, None)
        if released is not None and len(finished) < request.params.n:
            raise released
        if len(finished) < request.params.n:
            raise ServiceUnavailableError(f"replica '{self.name}' ended the stream before finishing")

    def _stream(self, body: dict, headers: dict[str, str]) -> contextlib.AbstractAsyncContextManager[
            httpx.Response | Http1Response]:
        """The streamed POST of a generation: on the lean client where it applies, else on httpx."""
        content = _ENCODE(body).encode()
        if self._lean is not None:
            return self._lean.stream("POST", "/v1/completions", content, headers)
        return self._client.stream("POST", "/v1/completions", content=content,
                                   headers={**headers, "Content-Type": "application/json"})

    def _to_output(self, request: GenerateRequest, data: dict, events: EngineEvents,
                   finished: set[int], prompt: str | None) -> RequestOutput | None:
        now = time.monotonic()
        outs = []
        for choice in data.get("choices") or []:
            idx = int(choice.get("index", 0))
            reason = choice.get("finish_reason")
            if reason is not None:
                finished.add(idx)
            text = choice.get("text") or ""
            ids = choice.get("token_ids") or self._token_ids(text)
            logprobs = completion_logprobs(choice.get("logprobs"), ids) if request.params.logprobs is not None else None
            outs.append(CompletionOutput(index=idx, text=text, token_ids=list(ids), finish_reason=reason,
                                         logprobs=logprobs))
        if not outs:
            return None  # the usage-only chunk
        if events.first_token is None:
            events.first_token = now
        done = len(finished) >= request.params.n
        if done:
            events.finished = now
        return RequestOutput(request_id=request.request_id, outputs=outs,
                             prompt_token_ids=request.prompt_token_ids, num_cached_tokens=cached_tokens(data),
                             finished=done, prompt=prompt,
                             # (a copy of the receipt times, the only events a remote stream has:
                             # built directly, dataclasses.replace's field walk cost more per chunk)
                             events=EngineEvents(queued=events.queued, first_token=events.first_token,
                                                 finished=events.finished))

    def _token_ids(self, text: str) -> list[int]:
        """OpenAI streams carry text, not ids. Servers that send `token_ids` (vLLM's
        `return_token_ids`) are used as is; otherwise the delta is re-encoded with the gateway's
        tokenizer so usage counts and token timings work (ids can differ from the engine's at
        token boundaries; counts are what the layers above use)."""
        if not text:
            return []
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids) or [-1]
        return [-1]  # one chunk is at least one token; the id is unknown

    async def abort(self, request_id: str) -> None:
        resp = self._open.pop(request_id, None)
        if resp is not None:
            await resp.aclose()

    async def reset_prefix_cache(self) -> int:
        """vLLM's (and `tokenpath engine`'s) POST /reset_prefix_cache on the server behind this replica."""
        r = await self._client.post("/reset_prefix_cache", timeout=self.config.connect_timeout_s)
        if r.status_code >= 400:
            raise ServiceUnavailableError(f"replica '{self.name}' could not reset its prefix cache ({r.status_code})")
        return 0


async def _sse_data(resp: httpx.Response | Http1Response) -> AsyncIterator[dict]:
    lines = resp.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            await _drain(lines)
            return
        data = json.loads(prompt_payload(payload))  # (the echoed prompt ids are not parsed)
        if "error" in data and not data.get("choices"):
            err = data["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            if isinstance(err, dict) and err.get("code") == "engine_failed":
                raise RequestFailedError(f"replica error: {message}")
            raise ServiceUnavailableError(f"replica error: {message}")
        yield data


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read a stream's end after its `[DONE]` (the chunked body's last, empty chunk follows it at
    once), so that httpx puts the connection back in its pool: a response closed before its body
    ended closes its connection, and every request would pay a new one (a TCP connect on the
    gateway and an accept on the server, ~1 ms of the gateway's added TTFT). A server that keeps
    the stream open past `[DONE]` costs at most `DRAIN_S`, and then its connection."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass


def _http_error(name: str, resp: httpx.Response | Http1Response) -> Exception:
    error_code = None
    try:
        message = resp.json()["error"]["message"]
        error_code = resp.json()["error"].get("code")
    except Exception:
        message = resp.text[:500]
    code = resp.status_code
    if error_code == "engine_failed":  # the engine survived this request; another one would not
        return RequestFailedError(f"replica '{name}' failed the request: {message}")
    if code in (429, 503):
        return ReplicaBusyError(f"replica '{name}' is busy ({code}): {message}")
    if code in (400, 413, 422):  # the request's own fault, the same on every replica
        return InvalidRequestError(f"replica '{name}' refused the request: {message}")
    # 401/403/404 mean a misconfigured replica (key, model name), 5xx a broken one: eject it.
    return ServiceUnavailableError(f"replica '{name}' answered {code}: {message}")
