"""`tokenpath serve` with its two windows on each request's way to the first byte timed, on the
event loop's thread (benchmarks/gateway_ttft_path.py starts it; issue 37):

    TOKENPATH_TTFT_PATH_OUT=windows.json [TOKENPATH_TTFT_PATH_PROFILE=path.pstats] \\
        python -m benchmarks.ttft_path_hooks serve ...

- window A: the request's bytes reach the gateway (uvicorn's `data_received`, before its parse)
  -> the generation's request is written to the backend (`replica.http1`, the `POST`'s write);
- window B: the backend's first SSE data reaches the gateway (its connection's `data_received`)
  -> the reply's first body bytes are handed to the client's connection (uvicorn's `send`).

Each window's wall time (perf_counter), the loop thread's CPU (thread_time) and the process's CPU
(all threads: the audit writer's, executor workers') are kept per request and written as JSON
when the server exits. With `TOKENPATH_TTFT_PATH_PROFILE`, cProfile runs inside the windows only,
so its figures are the critical path's and nothing else's (cProfile inflates what it measures:
read its shares, not its milliseconds). One request at a time is assumed (a second request's
bytes arriving inside a window are not a window of their own), each sent in one segment that
starts `POST /v1/`. `TOKENPATH_TTFT_PATH_POLL_S`: URL replicas polled that often (`poll_every`);
`TOKENPATH_TTFT_PATH_FREEZE=1`: the heap frozen (`gc.freeze`) before the first request. The
cyclic collector's pauses inside each window are kept too (`a_gc`, ms; `a_gc0`..: collections),
and each request's Timeline stamps, in ms from `received`, go to the same path + `.stamps`.
"""

from __future__ import annotations

import atexit
import cProfile
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from uvicorn.protocols.http import httptools_impl

from tokenpath.replica import http1


class Windows:
    def __init__(self, profile: bool) -> None:
        self.rows: list[dict[str, float]] = []
        self.profiler = cProfile.Profile() if profile else None
        self.open: dict[str, float] | None = None  # the request in progress: its marks
        self.window: str | None = None  # "a" or "b" while one runs
        self.posted = False  # a generation POST was issued: its write ends window A
        self.generation: Any = None  # that POST's response: its first data starts window B
        self.gc_started: float | None = None  # a collection in progress (inside a window)
        self.freeze = False  # gc.freeze() before the first request's window (a diagnostic)
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        """The cyclic collector's pauses inside a window: their ms, and how many per generation."""
        if self.window is None or self.open is None:
            return
        if phase == "start":
            self.gc_started = time.perf_counter()
        elif self.gc_started is not None:
            key = f"{self.window}_gc"
            self.open[key] = self.open.get(key, 0.0) + (time.perf_counter() - self.gc_started) * 1000
            gen = f"{self.window}_gc{info.get('generation', 0)}"
            self.open[gen] = self.open.get(gen, 0) + 1
            self.gc_started = None

    def start(self, name: str) -> None:
        if self.freeze:
            self.freeze = False
            gc.collect()
            gc.freeze()
        if name == "a" or self.open is None:  # (a request's first window: whatever was open is dropped)
            self.open = {}
        self.window = name
        self.open[f"{name}_wall"] = time.perf_counter()
        self.open[f"{name}_cpu"] = time.thread_time()
        self.open[f"{name}_proc"] = time.process_time()
        if self.profiler is not None:
            self.profiler.enable()

    def end(self, name: str) -> None:
        if self.profiler is not None:
            self.profiler.disable()
        wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        marks = self.open
        self.window = None
        if marks is None:
            return
        marks[f"{name}_wall"] = (wall - marks[f"{name}_wall"]) * 1000
        marks[f"{name}_cpu"] = (cpu - marks[f"{name}_cpu"]) * 1000
        marks[f"{name}_proc"] = (proc - marks[f"{name}_proc"]) * 1000
        if name == "b":
            self.rows.append({k: round(v, 4) for k, v in marks.items()})
            self.open = None

    def dump(self, path: str, profile: str | None) -> None:
        with open(path, "w") as f:
            json.dump(self.rows, f)
        if self.profiler is not None and profile:
            self.profiler.dump_stats(profile)


def install(w: Windows) -> None:
    received = httptools_impl.HttpToolsProtocol.data_received

    def data_received(self: Any, data: bytes) -> None:
        if w.window is None and data.startswith(b"POST /v1/"):  # (not the harness's /health polls)
            w.start("a")
        received(self, data)

    httptools_impl.HttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]

    stream = http1.Http1Pool.stream

    def posted_stream(self: Any, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Any:
        if method == "POST":
            w.posted = True
        return stream(self, method, path, body, headers)

    http1.Http1Pool.stream = posted_stream  # type: ignore[method-assign]

    awaited = http1.Http1Response._headers

    async def headers(self: Any) -> None:
        if w.posted:  # (called right after the request's write)
            w.posted = False
            w.generation = self
            if w.window == "a":
                w.end("a")
        await awaited(self)

    http1.Http1Response._headers = headers  # type: ignore[method-assign]

    backend = http1._Conn.data_received

    def backend_data(self: Any, data: bytes) -> None:
        if self.resp is not None and self.resp is w.generation and w.open is not None and w.window is None \
                and b"data:" in data:
            w.generation = None
            w.start("b")
        backend(self, data)

    http1._Conn.data_received = backend_data  # type: ignore[method-assign]

    send = httptools_impl.RequestResponseCycle.send

    async def cycle_send(self: Any, message: Any) -> None:
        await send(self, message)
        if w.window == "b" and message["type"] == "http.response.body" and message.get("body"):
            w.end("b")

    httptools_impl.RequestResponseCycle.send = cycle_send  # type: ignore[method-assign]


def poll_every(seconds: float) -> None:
    """URL replicas polled every `seconds` (a diagnostic: what the backend's /metrics renders,
    4 a second while busy, cost the requests behind them)."""
    from tokenpath.replica.remote import RemoteReplica

    init = RemoteReplica.__init__

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.config.poll_interval_s = seconds
        # Figures older than `stale_after_s` count as saturated (replica/remote.py), so polls
        # sparser than that would route nothing: they stay fresh for four polls here.
        self.config.stale_after_s = max(self.config.stale_after_s, 4 * seconds)

    RemoteReplica.__init__ = patched  # type: ignore[method-assign]


def keep_stamps(into: list[dict[str, float]]) -> None:
    """Each finished request's Timeline stamps, in ms from `received` (its stage-by-stage path)."""
    from tokenpath.api import run

    publish = run.publish

    def patched(record: Any, *args: Any) -> None:
        stamps = record.timeline.stamps
        t0 = stamps["received"]
        into.append({k: round((v - t0) * 1000, 3) for k, v in sorted(stamps.items(), key=lambda kv: kv[1])})
        publish(record, *args)

    run.publish = patched  # type: ignore[assignment]


def main() -> None:
    out = os.environ["TOKENPATH_TTFT_PATH_OUT"]
    profile = os.environ.get("TOKENPATH_TTFT_PATH_PROFILE")
    w = Windows(profile=bool(profile))
    w.freeze = os.environ.get("TOKENPATH_TTFT_PATH_FREEZE") == "1"
    install(w)
    if os.environ.get("TOKENPATH_TTFT_PATH_POLL_S"):
        poll_every(float(os.environ["TOKENPATH_TTFT_PATH_POLL_S"]))
    stamps: list[dict[str, float]] = []
    keep_stamps(stamps)
    atexit.register(w.dump, out, profile)
    atexit.register(lambda: Path(out + ".stamps").write_text(json.dumps(stamps)))
    from tokenpath.cli import main as cli

    sys.exit(cli())


if __name__ == "__main__":
    main()
