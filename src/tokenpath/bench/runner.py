"""Arrival processes and the run loop: warm-up, then the measured requests, per target and load point.

Open loop (Poisson at a rate, or a burst at rate=inf) issues requests on a seeded schedule whatever
the server does, optionally capped at a concurrency (as `vllm bench serve --max-concurrency`);
closed loop (concurrency N) keeps N requests in flight. Every run is bounded: a request count and/or
a duration after which no new request is issued, and a per-request timeout for those in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from tokenpath.bench.client import build_messages, send
from tokenpath.bench.metrics import Summary, summarize
from tokenpath.bench.records import LoadPoint, RequestRecord, RequestSpec, Target
from tokenpath.bench.workload import SHARES_PREFIXES, Workload

HARD_MAX_REQUESTS = 1_000_000
SUSPICIOUS_HIT_RATE = 0.5  # above this on a workload without shared prefixes, the run measured a cache


@dataclass(frozen=True)
class Bounds:
    num_requests: int | None = 100  # measured requests (None: until `duration`)
    duration: float | None = None  # seconds after which no new request is issued
    warmup: int = 1  # requests sent first and excluded from results
    request_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("a run needs a request count, a duration, or both")


@dataclass
class RunResult:
    target: Target
    load: LoadPoint
    records: list[RequestRecord]
    duration_s: float
    summary: Summary
    warmup_failed: int = 0
    warnings: list[str] = field(default_factory=list)


def poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Inter-arrival gaps (s) of a Poisson process at `rate` req/s; all zero for a burst (inf)."""
    rng = random.Random(int.from_bytes(hashlib.sha256(f"{seed}:arrivals".encode()).digest()[:16], "big"))
    while True:
        yield 0.0 if rate == float("inf") else rng.expovariate(rate)


class Sessions:
    """Multi-turn state for one run: each session's history, and turn-done signals so turn t is
    sent only after turn t-1 has its reply."""

    def __init__(self) -> None:
        self.history: dict[int, list[dict[str, str]]] = {}
        self._done: dict[tuple[int, int], asyncio.Event] = {}

    def _event(self, session: int, turn: int) -> asyncio.Event:
        return self._done.setdefault((session, turn), asyncio.Event())

    async def messages_for(self, spec: RequestSpec) -> list[dict[str, str]]:
        if spec.session is None:
            return build_messages(spec)
        if spec.turn > 0:
            await self._event(spec.session, spec.turn - 1).wait()
        return build_messages(spec, self.history.get(spec.session, []))

    def finish(self, spec: RequestSpec, rec: RequestRecord) -> None:
        if spec.session is None:
            return
        hist = self.history.setdefault(spec.session, [])
        hist += [{"role": "user", "content": spec.user_text}, {"role": "assistant", "content": rec.text}]
        self._event(spec.session, spec.turn).set()


class Progress:
    """A one-line progress bar on a terminal; a single summary line otherwise."""

    def __init__(self, label: str, total: int | None, duration: float | None,
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label, self.total, self.duration = label, total, duration
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.ok = self.err = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, rec: RequestRecord) -> None:
        if rec.success:
            self.ok += 1
        else:
            self.err += 1
        self.tick()

    def tick(self) -> None:
        """Redraw (terminal only, at most 10 times a second)."""
        now = time.perf_counter()
        if self.tty and now - self._last > 0.1:
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()

    async def ticker(self) -> None:
        """Keeps the elapsed time moving while slow requests are still in flight."""
        while True:
            await asyncio.sleep(0.5)
            self.tick()

    def _line(self, now: float) -> str:
        elapsed = now - self.t0
        done = self.ok + self.err
        frac = done / self.total if self.total else 0.0
        if self.duration:
            frac = max(frac, min(1.0, elapsed / self.duration))
        bar = "#" * int(frac * 30)
        of = f"/{self.total}" if self.total else ""
        return f"{self.label:<28} [{bar:<30}] {done}{of} ok={self.ok} err={self.err} {elapsed:6.1f}s"

    def close(self) -> None:
        if self.enabled:
            self.stream.write(("\r" if self.tty else "") + self._line(time.perf_counter()) + "\n")
            self.stream.flush()


async def run_point(target: Target, workload: Workload, load: LoadPoint, bounds: Bounds,
                    slo: dict[str, float], progress: bool = True) -> RunResult:
    """Warm up, then run one load point against one target."""
    timeout = httpx.Timeout(bounds.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment must never sit between the bench and loopback.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        warm_failed = await _warmup(client, target, workload, load, bounds)
        bar = Progress(f"{target.name} {load.label()}", bounds.num_requests, bounds.duration, enabled=progress)
        ticker = asyncio.create_task(bar.ticker()) if bar.tty else None
        try:
            records, duration = await _measure(client, target, workload, load, bounds, bar.update)
        finally:
            if ticker:
                ticker.cancel()
        bar.close()
    records.sort(key=lambda r: r.index)
    result = RunResult(target, load, records, duration, summarize(records, duration, slo), warm_failed)
    hits = result.summary.prefix_cache_hit_rate
    if hits is not None and hits > SUSPICIOUS_HIT_RATE and workload.config.kind not in SHARES_PREFIXES:
        result.warnings.append(
            f"{hits:.0%} of prompt tokens were prefix-cache hits on a '{workload.config.kind}' workload, whose "
            "prompts share no prefixes: the server has seen these prompts before (same --seed?), so TTFT "
            "measures its cache, not its prefill. Use a new seed or --reset-cache.")
    return result


async def reset_prefix_cache(target: Target) -> None:
    """POST /reset_prefix_cache on the target's server (vLLM's endpoint; tokenpath serves it too)."""
    root = target.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            resp = await client.post(f"{root}/reset_prefix_cache", headers=headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"target {target.name}: cannot reset its prefix cache: {exc}") from exc
    if resp.status_code >= 400:
        raise ValueError(f"target {target.name}: POST {root}/reset_prefix_cache answered {resp.status_code} "
                         f"({resp.text[:200]}); drop --reset-cache for servers without it")


async def _warmup(client: httpx.AsyncClient, target: Target, workload: Workload, load: LoadPoint,
                  bounds: Bounds) -> int:
    n = bounds.warmup
    if n <= 0:
        return 0
    width = max(1, min(n, load.concurrency or 1))
    specs = [workload.warmup_spec(k) for k in range(n)]
    sem = asyncio.Semaphore(width)

    async def one(spec: RequestSpec) -> RequestRecord:
        async with sem:
            return await send(client, target, spec, build_messages(spec), bounds.request_timeout)

    recs = await asyncio.gather(*(one(s) for s in specs))
    return sum(not r.success for r in recs)


@dataclass
class _Issuer:
    """Hands out request indices until the count or the duration runs out."""

    bounds: Bounds
    t0: float
    counter: Iterator[int] = field(default_factory=itertools.count)

    def next(self) -> int | None:
        b = self.bounds
        if b.duration is not None and time.perf_counter() - self.t0 >= b.duration:
            return None
        i = next(self.counter)
        limit = b.num_requests if b.num_requests is not None else HARD_MAX_REQUESTS
        return i if i < limit else None


async def _measure(client: httpx.AsyncClient, target: Target, workload: Workload, load: LoadPoint,
                   bounds: Bounds, on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float]:
    sessions = Sessions()
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    issuer = _Issuer(bounds, t0)

    async def one(i: int) -> None:
        spec = workload.spec(i)
        messages = await sessions.messages_for(spec)
        sent = time.perf_counter()
        rec = await send(client, target, spec, messages, bounds.request_timeout)
        rec.start = sent - t0
        sessions.finish(spec, rec)
        records.append(rec)
        on_done(rec)

    if load.rate is None:  # closed loop
        async def worker() -> None:
            while (i := issuer.next()) is not None:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(max(1, load.concurrency or 1))))
    else:
        await _open_loop(load, workload.config.seed, issuer, one)
    return records, time.perf_counter() - t0  # first send -> last completion


async def _open_loop(load: LoadPoint, seed: int, issuer: _Issuer, one: Callable[[int], object]) -> None:
    sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    tasks: list[asyncio.Task[None]] = []
    due = issuer.t0

    async def guarded(i: int) -> None:
        try:
            await one(i)  # type: ignore[misc]
        finally:
            if sem:
                sem.release()

    for gap in poisson_gaps(load.rate or float("inf"), seed):
        due += gap
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem:
            await sem.acquire()
        i = issuer.next()
        if i is None:
            if sem:
                sem.release()
            break
        tasks.append(asyncio.create_task(guarded(i)))
    await asyncio.gather(*tasks)


async def run_all(targets: list[Target], loads: list[LoadPoint], workload_for: Callable[[Target], Workload],
                  bounds: Bounds, slo: dict[str, float], progress: bool = True,
                  reset_cache: bool = False) -> list[RunResult]:
    """Each target in turn runs every load point; every target gets the same request list (same
    seed), and each load point its own prompts. `reset_cache`: reset the server's prefix cache first."""
    results = []
    for target in targets:
        wl = workload_for(target)
        for k, load in enumerate(loads):
            if reset_cache:
                await reset_prefix_cache(target)
            results.append(await run_point(target, wl.for_point(k), load, bounds, slo, progress))
    return results
