"""Benchmark 2: overload. Offered load at 1x, 2x, 5x and 10x the measured capacity, through
admission control, against real engine processes.

1. Capacity: closed-loop clients, as many as the deployment has dispatch slots, for
   `--capacity-s` seconds: completions per second is the capacity (and the admission controller's
   service-time estimate is warm afterwards).
2. Each level: Poisson arrivals at k x capacity for `--level-s` seconds. Every request carries a
   deadline of `--slo` seconds (the TTFT SLO): admission rejects at once (429 + Retry-After) what
   it predicts cannot start in time, and removes (504) what waits past it.
3. Per level: admitted TTFT p50/p99 against the SLO, goodput (completions with TTFT <= SLO per
   second, and as a share of the 1x figure), rejection latency p50/p99/max, outcomes, gateway and
   engine RSS before/after, engines alive.

    .venv/bin/python benchmarks/overload.py                       # defaults: ~3-4 minutes on 2 cores
    .venv/bin/python benchmarks/overload.py --level-s 5 --capacity-s 5 --levels 1,5   # smoke run

Writes benchmarks/results/overload.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_common import (  # noqa: E402
    Record,
    make_request,
    pct,
    rand_tokens,
    rss_mib,
    start_engines,
    stop_all,
    timed,
)

from tokenpath.admission.controller import AdmissionConfig  # noqa: E402
from tokenpath.replica.pool import PoolConfig  # noqa: E402
from tokenpath.routing.models import Deployment, ModelRouter  # noqa: E402
from tokenpath.server.routing_config import load_tokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


Send = Callable[[list[int]], Awaitable[Record]]


def direct_sender(dep: Deployment, args: argparse.Namespace) -> Send:
    async def send(tokens: list[int]) -> Record:
        return await timed(dep, make_request(tokens, args.max_tokens))
    return send


def http_sender(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> Send:
    """Through the whole gateway: HTTP, the API layer, admission, the replicas."""
    async def send(tokens: list[int]) -> Record:
        rec = Record(prompt=len(tokens))
        body = {"model": model, "prompt": tokens, "max_tokens": args.max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        if args.timeout:  # the client's own deadline: admission must 429 up front what misses it
            body["timeout"] = args.timeout
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    rec.outcome, rec.reject_s = str(resp.status_code), time.perf_counter() - t0
                    if resp.status_code == 504:  # where it timed out: in the gateway queue, or after dispatch
                        rec.extra["where"] = "queue" if "in the queue" in resp.text else "after dispatch"
                        rec.extra["timing_504"] = resp.headers.get("server-timing", "")
                    rec.extra["retry_after"] = resp.headers.get("retry-after")
                    timing = dict(p.split(";dur=") for p in resp.headers.get("server-timing", "").split(", ")
                                  if ";dur=" in p)
                    if "total" in timing:
                        rec.extra["server_ms"] = float(timing["total"])
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        data = json.loads(line[5:])
                        if "error" in data:
                            rec.outcome = str(data["error"].get("code") or "error")
                        elif data.get("choices") and data["choices"][0].get("text"):
                            rec.ttft = rec.ttft or time.perf_counter() - t0
                            rec.tokens += 1
        except httpx.HTTPError as exc:
            rec.outcome, rec.extra["error"] = "error", f"{type(exc).__name__}: {exc}"
        rec.e2e = time.perf_counter() - t0
        return rec
    return send


async def capacity(dep: Deployment, send: Send, rng: random.Random, args: argparse.Namespace
                   ) -> tuple[float, float]:
    """Saturated throughput (req/s) and the TTFT p99 at that point. With as many clients as
    dispatch slots nothing waits in the gateway, so that TTFT is time spent in the engine."""
    slots = dep.flow.pool.slots()
    stop = time.perf_counter() + args.capacity_s
    done: list[Record] = []

    async def client() -> None:
        while time.perf_counter() < stop:
            done.append(await send(rand_tokens(rng, args.prompt_tokens)))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(slots)))
    rate = sum(r.outcome == "ok" for r in done) / (time.perf_counter() - t0)
    return rate, pct([r.ttft for r in done if r.ttft is not None], 99)


async def level(send: Send, rng: random.Random, rate: float, args: argparse.Namespace) -> dict:
    tasks: list[asyncio.Task] = []
    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.level_s:
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(rand_tokens(rng, args.prompt_tokens))))
    records: list[Record] = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    gc.collect()
    ok = [r for r in records if r.outcome == "ok"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    rejects = [r.reject_s for r in records if r.outcome == "429" and r.reject_s is not None]
    server_ms = [r.extra["server_ms"] for r in records if r.outcome == "429" and "server_ms" in r.extra]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    errors = sorted({r.extra["error"] for r in records if "error" in r.extra})[:5]
    where_504: dict[str, int] = {}
    for r in records:
        if "where" in r.extra:
            where_504[r.extra["where"]] = where_504.get(r.extra["where"], 0) + 1
    timing_504 = [r.extra["timing_504"] for r in records if "timing_504" in r.extra][:10]
    return {"offered_rps": rate, "arrivals": len(records), "outcomes": outcomes, "where_504": where_504,
            "timing_504": timing_504, "wall_s": wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_max_s": max(ttft, default=float("nan")),
            "goodput_rps": sum(1 for x in ttft if x <= args.slo) / args.level_s,
            "reject_p50_ms": pct(rejects, 50) * 1000, "reject_p99_ms": pct(rejects, 99) * 1000,
            "reject_max_ms": max(rejects, default=float("nan")) * 1000,
            "reject_server_p99_ms": pct(server_ms, 99), "reject_server_max_ms": max(server_ms, default=float("nan")),
            "retry_after_s": sorted({r.extra["retry_after"] for r in records if r.extra.get("retry_after")}),
            "gateway_rss_mib": [round(rss0, 1), round(rss_mib(), 1)], "errors": errors,
            "t_start": time.time() - wall, "t_end": time.time()}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    base = rows[0]["goodput_rps"] or float("nan")
    lines = [f"| load | offered (req/s) | arrivals | ok / 429 / 504 / other | 504 share of admitted | "
             f"admitted TTFT p50 (s) | "
             f"admitted TTFT p99 (s) (SLO {args.slo:g}) | goodput (req/s) | goodput vs 1x | "
             "rejection p50 / p99 / max (ms), client | rejection p99 / max (ms), server | gateway RSS (MiB) | "
             "engine RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r["outcomes"]
        other = sum(v for k, v in o.items() if k not in ("ok", "429", "504"))
        admitted = sum(v for k, v in o.items() if k != "429")  # everything not refused up front
        lines.append(
            f"| {r['load']}x | {r['offered_rps']:.2f} | {r['arrivals']} | {o.get('ok', 0)} / {o.get('429', 0)} / "
            f"{o.get('504', 0)} / {other} | {o.get('504', 0) / max(admitted, 1):.1%} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['goodput_rps']:.2f} | "
            f"{r['goodput_rps'] / base:.0%} | {r['reject_p50_ms']:.2f} / {r['reject_p99_ms']:.2f} / "
            f"{r['reject_max_ms']:.2f} | {r['reject_server_p99_ms']:.2f} / {r['reject_server_max_ms']:.2f} | "
            f"{r['gateway_rss_mib'][0]:.0f} -> {r['gateway_rss_mib'][1]:.0f} | "
            f"{' '.join(f'{a:.0f}->{b:.0f}' for a, b in r['engine_rss_mib'])} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    if args.client:
        return await client_main(args)
    engine_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    replicas, procs = await start_engines(args.replicas, engine_args, threads=args.threads)
    rng = random.Random(args.seed)
    # No engine-side queue (max_engine_waiting=0): every waiting request waits in the gateway, where
    # its deadline and the admission decision can act on it.
    model = replicas[0].info.model
    dep = Deployment(model, "chat", list(replicas), policy="least_loaded",
                     admission=AdmissionConfig(max_queue=args.max_queue, initial_service_s=1.0),
                     pool_config=PoolConfig(max_engine_waiting=0))
    rows: list[dict] = []
    server = None
    try:
        send = direct_sender(dep, args)
        await asyncio.gather(*(send(rand_tokens(rng, 16)) for _ in range(len(replicas))))
        cap, engine_ttft = await capacity(dep, send, rng, args)
        # A request must leave the queue early enough that the engine can still make the SLO: the
        # operator's default deadline for priority 0 is set to that budget.
        args.queue_budget = max(0.5, args.slo - engine_ttft)
        dep.admission.default_deadline_s[0] = args.queue_budget
        print(f"capacity {cap:.2f} req/s; service time {dep.flow.capacity.service_s:.2f}s; TTFT p99 at "
              f"capacity {engine_ttft:.2f}s; queue budget {args.queue_budget:.2f}s", flush=True)
        loads = [float(x) for x in args.levels.split(",")]
        if args.http:
            dep.tokenizer = await asyncio.to_thread(load_tokenizer, model)
            server, url = await start_gateway(ModelRouter([dep]))
            rows = await run_client_process(url, model, [k * cap for k in loads], procs, args)
        else:
            for k in loads:
                engine_rss0 = [rss_mib(p.proc.pid) for p in procs]
                row = await level(send, rng, k * cap, args)
                row["engine_rss_mib"] = list(zip(engine_rss0, [rss_mib(p.proc.pid) for p in procs], strict=True))
                row["engines_alive"] = all(p.proc.returncode is None for p in procs)
                print(json.dumps(row), flush=True)
                rows.append(row)
                await asyncio.sleep(args.cooldown_s)
        for k, row in zip(loads, rows, strict=True):
            row["load"] = f"{k:g}"
    finally:
        if server is not None:
            server.should_exit = True
            await server.task
        await dep.flow.close()
        await stop_all(replicas, procs)
    write(rows, cap, args)
    return 0


async def run_client_process(url: str, model: str, rates: list[float], procs, args: argparse.Namespace) -> list[dict]:
    """The load generator in its own process, so its event loop does not share the gateway's."""
    cmd = [sys.executable, __file__, "--client", url, "--model", model, "--rates", ",".join(f"{r:.4f}" for r in rates)]
    for flag in ("level_s", "cooldown_s", "slo", "prompt_tokens", "max_tokens", "seed", "timeout"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    child = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    samples: list[tuple[float, float, list[float]]] = []

    async def sample() -> None:
        while True:
            samples.append((time.time(), rss_mib(), [rss_mib(p.proc.pid) for p in procs]))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    rows = []
    assert child.stdout is not None
    async for line in child.stdout:
        if line.startswith(b"{"):
            rows.append(json.loads(line))
            print(line.decode().strip(), flush=True)
    await child.wait()
    sampler.cancel()
    for row in rows:
        near = lambda t: min(samples, key=lambda x: abs(x[0] - t))  # noqa: E731
        a, b = near(row["t_start"]), near(row["t_end"])
        row["gateway_rss_mib"] = [a[1], b[1]]
        row["engine_rss_mib"] = list(zip(a[2], b[2], strict=True))
        row["engines_alive"] = all(p.proc.returncode is None for p in procs)
    return rows


async def client_main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(base_url=args.client, timeout=300,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as c:
        send = http_sender(c, args.model, args)
        for rate in (float(x) for x in args.rates.split(",")):
            print(json.dumps(await level(send, rng, rate, args)), flush=True)
            await asyncio.sleep(args.cooldown_s)
    return 0


def write(rows: list[dict], cap: float, args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = ("HTTP from a separate client process through the gateway app (API layer + admission + remote "
            "replicas)") if args.http else "`Deployment.generate` called directly in this process (no HTTP)"
    setup = (f"{args.replicas} `tokenpath engine` processes (SmolLM2-135M, CPU, {args.threads} thread each, "
             f"num_kv_blocks {args.num_kv_blocks}, max_num_seqs {args.max_num_seqs}); requests: "
             f"{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, TTFT SLO "
             f"{args.slo:g}s, client `timeout` {args.timeout:g}s, queue deadline {args.queue_budget:.2f}s (SLO - TTFT p99 at capacity); measured "
             f"capacity {cap:.2f} req/s over {args.capacity_s:g}s; Poisson arrivals for {args.level_s:g}s per "
             f"level; gateway queue cap {args.max_queue}; path: {path}; "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    alive = all(r["engines_alive"] for r in rows)
    md = (f"# Overload: admission control at 1x-10x capacity\n\n{setup}\n\n{table(rows, args)}\n\n"
          f"Engines alive after every level: {alive}. Client rejection latency: from sending the request to "
          f"receiving the 429; server: the 429's own Server-Timing total (HTTP mode only).\n\n"
          f"Command: `.venv/bin/python benchmarks/overload.py {' '.join(sys.argv[1:])}`\n")
    (RESULTS / f"{args.out}.md").write_text(md)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"setup": setup, "capacity_rps": cap, "rows": rows},
                                                        indent=2))
    print(md)


async def start_gateway(router: ModelRouter) -> tuple[uvicorn.Server, str]:
    """The real app (API layer, no auth) on a free loopback port, in this process. uvicorn binds the
    port itself, as `tokenpath serve` does (handing it a pre-bound socket costs ~40 ms per response
    here: the accepted connections then lack TCP_NODELAY)."""
    from tokenpath.api.app import create_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", access_log=False))
    server.task = asyncio.create_task(server.serve())  # type: ignore[attr-defined]
    while not server.started:
        await asyncio.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--slo", type=float, default=5.0, help="TTFT SLO in seconds (also each request's deadline)")
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--capacity-s", type=float, default=20.0)
    p.add_argument("--level-s", type=float, default=20.0)
    p.add_argument("--cooldown-s", type=float, default=2.0)
    p.add_argument("--levels", default="1,2,5,10")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=0.0,
                   help="HTTP mode: each request's `timeout` body field in seconds, the client's own deadline "
                        "(0: none; issue 10 measures --slo 10 --timeout 10)")
    p.add_argument("--http", action="store_true",
                   help="send the levels over HTTP from a separate client process through the gateway app")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the HTTP load generator
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rates", help=argparse.SUPPRESS)
    p.add_argument("--out", default="overload")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
