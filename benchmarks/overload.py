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
import sys
import time
from pathlib import Path

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
from tokenpath.routing.models import Deployment  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


async def capacity(dep: Deployment, rng: random.Random, args: argparse.Namespace) -> tuple[float, float]:
    """Saturated throughput (req/s) and the TTFT p99 at that point. With as many clients as
    dispatch slots nothing waits in the gateway, so that TTFT is time spent in the engine."""
    slots = dep.flow.pool.slots()
    stop = time.perf_counter() + args.capacity_s
    done: list[Record] = []

    async def client() -> None:
        while time.perf_counter() < stop:
            done.append(await timed(dep, make_request(rand_tokens(rng, args.prompt_tokens), args.max_tokens)))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(slots)))
    rate = sum(r.outcome == "ok" for r in done) / (time.perf_counter() - t0)
    return rate, pct([r.ttft for r in done if r.ttft is not None], 99)


async def level(dep: Deployment, rng: random.Random, rate: float, args: argparse.Namespace) -> dict:
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
        r = make_request(rand_tokens(rng, args.prompt_tokens), args.max_tokens, deadline_s=args.queue_budget)
        tasks.append(asyncio.create_task(timed(dep, r)))
    records: list[Record] = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    gc.collect()
    ok = [r for r in records if r.outcome == "ok"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    rejects = [r.reject_s for r in records if r.outcome == "429" and r.reject_s is not None]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    errors = sorted({r.extra["error"] for r in records if "error" in r.extra})[:5]
    return {"offered_rps": rate, "arrivals": len(records), "outcomes": outcomes, "wall_s": wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_max_s": max(ttft, default=float("nan")),
            "goodput_rps": sum(1 for x in ttft if x <= args.slo) / args.level_s,
            "reject_p50_ms": pct(rejects, 50) * 1000, "reject_p99_ms": pct(rejects, 99) * 1000,
            "reject_max_ms": max(rejects, default=float("nan")) * 1000,
            "gateway_rss_mib": [round(rss0, 1), round(rss_mib(), 1)], "errors": errors}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    base = rows[0]["goodput_rps"] or float("nan")
    lines = [f"| load | offered (req/s) | arrivals | ok / 429 / 504 / other | admitted TTFT p50 (s) | "
             f"admitted TTFT p99 (s) (SLO {args.slo:g}) | goodput (req/s) | goodput vs 1x | "
             "rejection p50 / p99 / max (ms) | gateway RSS (MiB) | engine RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r["outcomes"]
        other = sum(v for k, v in o.items() if k not in ("ok", "429", "504"))
        lines.append(
            f"| {r['load']}x | {r['offered_rps']:.2f} | {r['arrivals']} | {o.get('ok', 0)} / {o.get('429', 0)} / "
            f"{o.get('504', 0)} / {other} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['goodput_rps']:.2f} | "
            f"{r['goodput_rps'] / base:.0%} | {r['reject_p50_ms']:.2f} / {r['reject_p99_ms']:.2f} / "
            f"{r['reject_max_ms']:.2f} | {r['gateway_rss_mib'][0]:.0f} -> {r['gateway_rss_mib'][1]:.0f} | "
            f"{' '.join(f'{a:.0f}->{b:.0f}' for a, b in r['engine_rss_mib'])} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    engine_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    replicas, procs = await start_engines(args.replicas, engine_args, threads=args.threads)
    rng = random.Random(args.seed)
    # No engine-side queue (max_engine_waiting=0): every waiting request waits in the gateway, where
    # its deadline and the admission decision can act on it.
    dep = Deployment("smollm2-135m-instruct", "chat", list(replicas), policy="least_loaded",
                     admission=AdmissionConfig(max_queue=args.max_queue, initial_service_s=1.0),
                     pool_config=PoolConfig(max_engine_waiting=0))
    rows: list[dict] = []
    try:
        await asyncio.gather(*(timed(dep, make_request(rand_tokens(rng, 16), 2)) for _ in range(len(replicas))))
        cap, engine_ttft = await capacity(dep, rng, args)
        # A request must leave the queue early enough that the engine can still make the SLO.
        args.queue_budget = max(0.5, args.slo - engine_ttft)
        print(f"capacity {cap:.2f} req/s; service time {dep.flow.capacity.service_s:.2f}s; TTFT p99 at "
              f"capacity {engine_ttft:.2f}s; queue budget {args.queue_budget:.2f}s", flush=True)
        for k in [float(x) for x in args.levels.split(",")]:
            engine_rss0 = [rss_mib(p.proc.pid) for p in procs]
            row = await level(dep, rng, k * cap, args)
            row["load"] = f"{k:g}"
            row["engine_rss_mib"] = list(zip(engine_rss0, [rss_mib(p.proc.pid) for p in procs], strict=True))
            row["engines_alive"] = all(p.proc.poll() is None for p in procs)
            print(json.dumps(row), flush=True)
            rows.append(row)
            await asyncio.sleep(args.cooldown_s)
    finally:
        await dep.flow.close()
        await stop_all(replicas, procs)
    RESULTS.mkdir(exist_ok=True)
    setup = (f"{args.replicas} `tokenpath engine` processes (SmolLM2-135M, CPU, {args.threads} thread each, "
             f"num_kv_blocks {args.num_kv_blocks}, max_num_seqs {args.max_num_seqs}); requests: "
             f"{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, TTFT SLO "
             f"{args.slo:g}s, queue deadline {args.queue_budget:.2f}s (SLO - TTFT p99 at capacity); measured capacity {cap:.2f} req/s over {args.capacity_s:g}s; Poisson arrivals for "
             f"{args.level_s:g}s per level; gateway queue cap {args.max_queue}; "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    alive = all(r["engines_alive"] for r in rows)
    md = (f"# Overload: admission control at 1x-10x capacity\n\n{setup}\n\n{table(rows, args)}\n\n"
          f"Engines alive after every level: {alive}. Rejections are measured from the call to "
          f"`Deployment.generate` to the 429 (no HTTP in between).\n\n"
          f"Command: `.venv/bin/python benchmarks/overload.py {' '.join(sys.argv[1:])}`\n")
    (RESULTS / f"{args.out}.md").write_text(md)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"setup": setup, "capacity_rps": cap, "rows": rows},
                                                        indent=2))
    print(md)
    return 0


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
    p.add_argument("--out", default="overload")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
