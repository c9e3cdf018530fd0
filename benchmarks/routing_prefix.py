"""Benchmark 1: a shared-prefix workload on 2 local engine replicas, prefix_aware vs round_robin vs
least_loaded, in the same run and against the same engine processes.

Workload: G groups, each with its own long "system prompt" (the shared prefix) and R requests that
add a short unique question; requests from all groups are interleaved at random and sent by C
closed-loop clients. Each policy gets *fresh* prefixes (so no policy inherits another's cache).
Each engine's KV pool (288 blocks of 16 tokens) holds about 9 of the 10 groups' 512-token
prefixes with nothing else running: a policy that keeps each group on one replica needs only
half of them per replica, one that spreads groups makes every replica hold (and evict) them all.

Engine settings: `--long-prefill-token-threshold 128` (a prefix hit does not wait behind a whole
512-token cold prefill on a 1-thread engine) and `--load-threshold 2.0` for prefix_aware: with
`max_num_seqs 2` a load-score unit is only two requests, so the default 1.0 escapes to a cold
replica as soon as the matched one runs a full batch of cheap hits.

    .venv/bin/python benchmarks/routing_prefix.py                 # defaults: ~8 minutes on 2 cores
    .venv/bin/python benchmarks/routing_prefix.py --groups 4 --per-group 3   # a quick smoke run

Writes benchmarks/results/routing_prefix.md (table) and .json (every number).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_common import (
    Record,
    engine_counters,
    make_request,
    pct,
    rand_tokens,
    start_engines,
    stop_all,
    timed,
)

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.replica.pool import PoolConfig
from tokenpath.routing.models import Deployment

RESULTS = Path(__file__).resolve().parent / "results"


def workload(rng: random.Random, groups: int, per_group: int, prefix: int, suffix: int) -> list[list[int]]:
    prefixes = [rand_tokens(rng, prefix) for _ in range(groups)]
    prompts = [p + rand_tokens(rng, suffix) for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def run_policy(policy: str, replicas, procs, prompts: list[list[int]], args) -> dict:
    """One pass of one policy over `prompts`: the raw records and engine-counter deltas."""
    options = {"load_threshold": args.load_threshold} if policy in ("prefix_aware", "session_affinity") else {}
    dep = Deployment("smollm2-135m-instruct", "chat", list(replicas), policy=policy, picker_options=options,
                     admission=AdmissionConfig(max_queue=10_000, fallback_deadline_s=3600,
                                               default_deadline_s={}),
                     pool_config=PoolConfig())
    before = await engine_counters(procs)
    todo = list(prompts)
    records: list[Record] = []

    async def client() -> None:
        while todo:
            records.append(await timed(dep, make_request(todo.pop(), args.max_tokens)))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    after = await engine_counters(procs)
    await dep.flow.close()
    return {"records": records, "wall": wall,
            "queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"]}


def summarize(policy: str, runs: list[dict]) -> dict:
    records = [r for run in runs for r in run["records"]]
    wall = sum(run["wall"] for run in runs)
    queries, hits = sum(run["queries"] for run in runs), sum(run["hits"] for run in runs)
    ok = [r for r in records if r.outcome == "ok"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica or "?"] = per_replica.get(r.replica or "?", 0) + 1
    return {"policy": policy, "requests": len(records), "ok": len(ok), "wall_s": wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_mean_s": sum(ttft) / max(1, len(ttft)),
            "e2e_p50_s": pct([r.e2e for r in ok if r.e2e], 50),
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "throughput_rps": len(ok) / wall, "output_tok_s": sum(r.tokens for r in ok) / wall,
            "per_replica": per_replica,
            "reasons": {k: sum(1 for r in ok if r.reason == k) for k in {r.reason for r in ok}},
            "ttft_p50_by_round_s": [pct([r.ttft for r in run["records"] if r.ttft is not None], 50) for run in runs]}


def table(rows: list[dict], args, base: dict) -> str:
    lines = ["| policy | TTFT p50 (s) | TTFT p99 (s) | TTFT p50 vs round_robin | prefix-cache hit rate | "
             "throughput (req/s) | output tok/s | requests per replica |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = base["ttft_p50_s"] / r["ttft_p50_s"] if r["ttft_p50_s"] else float("nan")
        lines.append(f"| {r['policy']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {speedup:.2f}x | "
                     f"{r['prefix_hit_rate']:.1%} | {r['throughput_rps']:.2f} | {r['output_tok_s']:.1f} | "
                     f"{', '.join(f'{k}: {v}' for k, v in sorted(r['per_replica'].items()))} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    engine_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                   "--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    t0 = time.perf_counter()
    replicas, procs = await start_engines(2, engine_args, threads=args.threads)
    print(f"2 engines up in {time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    try:
        rng = random.Random(args.seed)
        # Warm both engines (first forward passes are slow) with throwaway prompts.
        warm = Deployment("warm", "chat", list(replicas), policy="round_robin")
        await asyncio.gather(*(timed(warm, make_request(rand_tokens(rng, 32), 2)) for _ in range(4)))
        policies = args.policies.split(",")
        raw: dict[str, list[dict]] = {p: [] for p in policies}
        # Rounds alternate the policy order (A B C, C B A, ...) so a drift in background load on
        # this shared machine does not favour whichever policy runs first.
        for rnd in range(args.rounds):
            for policy in policies if rnd % 2 == 0 else policies[::-1]:
                prompts = workload(rng, args.groups, args.per_group, args.prefix_tokens, args.suffix_tokens)
                raw[policy].append(await run_policy(policy, replicas, procs, prompts, args))
                print(policy, rnd, json.dumps(summarize(policy, raw[policy][-1:])), flush=True)
        rows = [summarize(p, raw[p]) for p in policies]
    finally:
        await stop_all(replicas, procs)
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    RESULTS.mkdir(exist_ok=True)
    setup = (f"{args.rounds} rounds (policy order alternating) of {args.groups} groups x {args.per_group} requests "
             f"per policy, fresh prefixes each round; prefix {args.prefix_tokens} tokens + "
             f"{args.suffix_tokens} unique, max_tokens {args.max_tokens}, {args.concurrency} closed-loop clients; "
             f"2 `tokenpath engine` processes (SmolLM2-135M, CPU, {args.threads} thread each), "
             f"num_kv_blocks {args.num_kv_blocks}, max_num_seqs {args.max_num_seqs}, "
             f"long_prefill_token_threshold {args.long_prefill_token_threshold}; "
             f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    md = (f"# Routing on a shared-prefix workload\n\n{setup}\n\n{table(rows, args, base)}\n\n"
          f"Command: `.venv/bin/python benchmarks/routing_prefix.py {' '.join(sys.argv[1:])}`\n")
    (RESULTS / f"{args.out}.md").write_text(md)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
    print(md)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=288)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--long-prefill-token-threshold", type=int, default=128,
                   help="engine prefill chunk cap per request (0: none)")
    p.add_argument("--load-threshold", type=float, default=2.0)
    p.add_argument("--policies", default="prefix_aware,round_robin,least_loaded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="routing_prefix")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
