"""Shared pieces of the routing and overload benchmarks: engine processes, request records,
percentiles, engine counters, process memory.

The benchmarks drive `Deployment.generate` (admission -> queue -> pick -> replica) in this process
against real `tokenpath engine` processes on the engine link, so what they time is the middle of
the path plus the engines, without the HTTP front of the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from dataclasses import dataclass, field

from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.link_client import EngineLinkReplica
from tokenpath.replica.processes import EngineProcess, spawn_engines
from tokenpath.routing.models import Deployment
from tokenpath.telemetry.timeline import Timeline

_ids = itertools.count()


@dataclass
class Record:
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    cached: int = 0
    prompt: int = 0
    outcome: str = "ok"  # ok | 429 | 503 | 504 | error
    reject_s: float | None = None  # time to the rejection, for rejected requests
    replica: str | None = None
    reason: str | None = None
    extra: dict = field(default_factory=dict)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def make_request(tokens: list[int], max_tokens: int, tenant: str = "bench",
                 deadline_s: float | None = None) -> Submission[GenerateRequest]:
    rid = f"bench-{next(_ids)}"
    r = Submission(GenerateRequest(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True), tenant=tenant), Timeline(rid))
    if deadline_s is not None:
        r.request.deadline = r.timeline.stamps["received"] + deadline_s
    return r


async def timed(dep: Deployment, r: Submission[GenerateRequest]) -> Record:
    from tokenpath.errors import TokenpathError

    rec = Record(prompt=len(r.prompt_token_ids))
    t0 = time.perf_counter()
    try:
        async for out in dep.generate(r):
            if rec.ttft is None:
                rec.ttft = time.perf_counter() - t0
            rec.tokens += sum(len(o.token_ids) or (1 if o.text else 0) for o in out.outputs)
            if out.finished:
                rec.cached = out.num_cached_tokens
    except TokenpathError as exc:
        rec.outcome = str(exc.status_code)
        rec.reject_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - recorded, counted, reported
        rec.outcome = "error"
        rec.extra["error"] = f"{type(exc).__name__}: {exc}"
    rec.e2e = time.perf_counter() - t0
    rec.replica = r.timeline.attrs.get("replica")  # type: ignore[assignment]
    rec.reason = r.timeline.attrs.get("reason")  # type: ignore[assignment]
    return rec


async def start_engines(n: int, engine_args: list[str], threads: int = 1
                        ) -> tuple[list[EngineLinkReplica], list[EngineProcess]]:
    """`n` engine processes; each gets `threads` torch threads so replicas do not fight over cores."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    max_seqs = int(engine_args[engine_args.index("--max-num-seqs") + 1]) if "--max-num-seqs" in engine_args else 0
    procs = await spawn_engines(n, engine_args=engine_args, max_num_seqs=max_seqs)
    return [p.replica for p in procs], procs


async def engine_counters(procs: list[EngineProcess]) -> dict[str, float]:
    """Prefix-cache queries/hits summed over the engines (from the state they push over the link)."""
    states = [p.replica.state() for p in procs]
    return {"prefix_cache_queries": float(sum(s.prefix_cache_queries for s in states)),
            "prefix_cache_hits": float(sum(s.prefix_cache_hits for s in states))}


def rss_mib(pid: int | None = None) -> float:
    """Resident memory of a process (this one by default), from /proc."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def stop_all(replicas: list[EngineLinkReplica], procs: list[EngineProcess]) -> None:
    await asyncio.gather(*(p.stop() for p in procs))
