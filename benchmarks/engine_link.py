"""Engine link vs in-process engine: what does crossing a process boundary cost?

Same run, same requests, same model and engine settings: one in-process engine
(`InProcessReplica`) and one `tokenpath engine` process on the engine link (`EngineLinkReplica`),
each behind a `Deployment` (admission, pick, the replica boundary's Timeline stamps), measured in
paired rounds. Each pair runs one fresh set of prompts through both modes, in-process first in
even pairs and link first in odd ones (drift on a shared machine hits both, in both orders). Fresh
prompts keep every round's work the same: with one set reused, each engine's prefix cache decided
how much prefill a round did, and CPU per token moved 7-12 ms between rounds of one mode. The
first pair at each concurrency warms both engines and is not reported.

Reported per pair: ITL p50 (gaps between token-bearing deltas as the consumer sees them), output
tokens/s, and CPU per output token of each process (from /proc, so other load on the machine moves
it much less than it moves time), split into each engine's step thread and the rest. The verdict is
the median of the paired differences with a distribution-free 95% interval for it (sign test), not
the difference of two medians taken separately. Then the gateway's own overhead: the real app (HTTP,
tokenizing, admission) in front of the link replica at concurrency 32, its `gateway` stage p50/p99
from the bodies' `tokenpath.timing`.

    setsid python benchmarks/engine_link.py                  # ~5-6 min on an idle 2-core box
    setsid python benchmarks/engine_link.py --rounds 4 --rounds-c1 2 --out engine_link_try   # ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from engine_link_report import render  # noqa: E402
from routing_common import pct, rand_tokens  # noqa: E402

from tokenpath.protocol import GenerateRequest, SamplingParams, Submission  # noqa: E402
from tokenpath.routing.models import Deployment  # noqa: E402
from tokenpath.telemetry.timeline import Timeline  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODES = ("in_process", "link")


async def one(dep: Deployment, tokens: list[int], max_tokens: int, tag: str, i: int) -> dict:
    rid = f"{tag}-{i}-{time.monotonic_ns()}"
    req = Submission(GenerateRequest(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                  ignore_eos=True)), Timeline(rid))
    gaps: list[float] = []
    delivery: list[float] = []  # engine event -> consumer receipt (both in this process's clock)
    last = None
    n = 0
    async for out in dep.generate(req):
        received = time.monotonic()
        k = sum(len(c.token_ids) for c in out.outputs)
        if k:
            now = time.perf_counter()
            if last is None and out.events.first_token is not None:
                delivery.append(received - out.events.first_token)
            if last is not None:
                gaps.append((now - last) / k)
            last = now
            n += k
        if out.finished and out.events.finished is not None:
            delivery.append(received - out.events.finished)
    return {"gaps": gaps, "tokens": n, "delivery": delivery}


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process so far (Linux /proc): `schedstat`'s nanoseconds on
    the CPU, else `stat`'s user + system clock ticks (10 ms: too coarse for a c=1 round's ~200
    tokens, where the link's cost is a fraction of a millisecond per token)."""
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            out[int(tid)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tck
    return out


def cpu_split(before: dict[int, float], after: dict[int, float], tokens: int) -> tuple[float, float]:
    """(busiest thread, all the others) in CPU ms per output token. The busiest thread over a
    round is the engine's step loop (model forward, sampling, detokenizing); the rest is the event
    loop (delivery, the link's framing, the consumer) and anything else the process runs."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True) or [0.0]
    return 1000 * used[0] / tokens, 1000 * sum(used[1:]) / tokens


async def level(dep: Deployment, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str,
                engine_pid: int | None = None) -> dict:
    """One round. CPU per output token of this process and, for the link, of the engine process."""
    sem = asyncio.Semaphore(concurrency)
    me = os.getpid()
    gw0, eng0 = thread_cpu_s(me), thread_cpu_s(engine_pid) if engine_pid else {}

    async def run(i: int, p: list[int]) -> dict:
        async with sem:
            return await one(dep, p, max_tokens, tag, i)

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    gw1, eng1 = thread_cpu_s(me), thread_cpu_s(engine_pid) if engine_pid else {}
    tokens = sum(r["tokens"] for r in rows)
    gaps = [g for r in rows for g in r["gaps"]]
    delivery = [d for r in rows for d in r["delivery"]]
    if engine_pid:  # this process is the gateway; the engine is the other one
        step, rest = cpu_split(eng0, eng1, tokens)
        gateway = 1000 * sum(gw1[t] - gw0.get(t, 0.0) for t in gw1) / tokens
    else:
        (step, rest), gateway = cpu_split(gw0, gw1, tokens), 0.0
    return {"itl_p50_ms": pct(gaps, 50) * 1000, "tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "delivery_p50_ms": pct(delivery, 50) * 1000, "cpu_step_ms_per_tok": step,
            "cpu_rest_ms_per_tok": rest, "cpu_gateway_ms_per_tok": gateway,
            "cpu_ms_per_tok": step + rest + gateway, "loadavg_1m": os.getloadavg()[0]}


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the median (sign test): the k-th smallest and k-th largest
    value, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None if n is too
    small for any (n < 6 at 95%)."""
    n, s = len(values), sorted(values)
    tail, k, cum = (1 - confidence) / 2, 0, 0.0
    while k < n:
        cum += math.comb(n, k) / 2**n  # P(X <= k)
        if cum > tail:
            break
        k += 1
    return (s[k - 1], s[n - k]) if k >= 1 else None


def paired(pairs: list[dict]) -> dict:
    """The verdict figures of one concurrency level from its paired rounds."""
    itl_d = [p["link"]["itl_p50_ms"] - p["in_process"]["itl_p50_ms"] for p in pairs]
    tps_r = [p["link"]["tok_s"] / p["in_process"]["tok_s"] for p in pairs]
    cpu_d = [p["link"]["cpu_ms_per_tok"] - p["in_process"]["cpu_ms_per_tok"] for p in pairs]
    med = statistics.median
    return {"n": len(pairs), "itl_diff_ms": itl_d, "itl_diff_median_ms": med(itl_d), "itl_diff_ci_ms": median_ci(itl_d),
            "itl_diff_iqr_ms": (pct(itl_d, 25), pct(itl_d, 75)), "link_slower": sum(d > 0 for d in itl_d),
            "tok_s_ratio": tps_r, "tok_s_ratio_median": med(tps_r), "tok_s_ratio_ci": median_ci(tps_r),
            "cpu_diff_ms": cpu_d, "cpu_diff_median_ms": med(cpu_d),
            **{f"{m}_{k}": med(p[m][k] for p in pairs) for m in MODES
               for k in ("itl_p50_ms", "tok_s", "delivery_p50_ms", "cpu_ms_per_tok", "cpu_step_ms_per_tok",
                         "cpu_rest_ms_per_tok", "cpu_gateway_ms_per_tok")}}


async def gateway_overhead(dep: Deployment, n: int, concurrency: int, max_tokens: int) -> dict:
    import httpx
    import uvicorn

    from tokenpath.api.app import create_app
    from tokenpath.routing.models import ModelRouter

    server = uvicorn.Server(uvicorn.Config(create_app(ModelRouter([dep])), host="127.0.0.1", port=0,
                                           log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    sem = asyncio.Semaphore(concurrency)
    stages: list[dict] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=300) as client:
        async def run(i: int) -> None:
            async with sem:
                r = await client.post("/chat/completions", json={
                    "model": dep.name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Request {i}: tell me about tea."}]})
                r.raise_for_status()
                stages.append(r.json()["tokenpath"]["timing"])
        await asyncio.gather(*(run(i) for i in range(n)))
    server.should_exit = True
    await task
    g = [s["gateway"] * 1000 for s in stages]
    return {"n": len(g), "gateway_p50_ms": pct(g, 50), "gateway_p99_ms": pct(g, 99),
            "total_p50_ms": pct([s["total"] * 1000 for s in stages], 50)}


async def main(args: argparse.Namespace) -> None:
    from tokenpath.config import EngineConfig
    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.replica.local import InProcessReplica
    from tokenpath.replica.processes import spawn_engines
    from tokenpath.server.memory import freeze_startup_heap

    started = time.monotonic()
    engine_args = ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
    local_engine = AsyncEngine(cfg)
    await local_engine.start()
    (proc,) = await spawn_engines(1, engine_args=engine_args, max_num_seqs=args.max_num_seqs, nice=0)
    # As the engine process does: a full GC here would walk the in-process engine's objects, in the
    # link rounds too (a `serve --replicas` gateway holds no engine), a ~100 ms stall that is no
    # part of what the link costs.
    freeze_startup_heap()
    tok = local_engine.tokenizer
    deps = {"in_process": Deployment(local_engine.model_name, "chat", [InProcessReplica(local_engine)],
                                     tokenizer=tok, max_model_len=local_engine.max_model_len),
            "link": Deployment(local_engine.model_name, "chat", [proc.replica], tokenizer=tok,
                               max_model_len=local_engine.max_model_len)}
    rng = random.Random(args.seed)
    results: dict = {"setup": {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args)}}
    try:
        for c, n, rounds in ((1, args.requests_c1, args.rounds_c1), (32, args.requests_c32, args.rounds)):
            pairs = []
            for r in range(args.warmup + rounds):
                prompts = [rand_tokens(rng, args.prompt_tokens) for _ in range(n)]
                order = MODES if r % 2 == 0 else MODES[::-1]
                pair: dict = {"first": order[0]}
                for name in order:
                    pair[name] = await level(deps[name], prompts, args.max_tokens, c, f"{name}-c{c}-{r}",
                                             engine_pid=proc.proc.pid if name == "link" else None)
                if r >= args.warmup:
                    pairs.append(pair)
                print(f"c={c} pair {r - args.warmup + 1}/{rounds}{' (warm-up)' if r < args.warmup else ''}: ITL "
                      f"{pair['in_process']['itl_p50_ms']:.1f} / {pair['link']['itl_p50_ms']:.1f} ms, CPU/token "
                      f"{pair['in_process']['cpu_ms_per_tok']:.2f} / {pair['link']['cpu_ms_per_tok']:.2f} ms "
                      f"(in-process / link), load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            results[f"c{c}"] = {"pairs": pairs, "summary": paired(pairs)}
        results["gateway_c32"] = await gateway_overhead(deps["link"], args.gateway_requests, 32, args.max_tokens)
    finally:
        await proc.stop()
        await local_engine.shutdown()
    results["setup"]["runtime_s"] = time.monotonic() - started
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    md = render(results, args)
    (RESULTS / f"{args.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="paired rounds at c=32 (after the warm-up)")
    p.add_argument("--rounds-c1", type=int, default=6, help="paired rounds at c=1 (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="pairs run first at each level and not reported")
    p.add_argument("--requests-c1", type=int, default=6)
    p.add_argument("--requests-c32", type=int, default=32, help="per round at c=32 (32: one full batch)")
    p.add_argument("--gateway-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="engine_link", help="results/<out>.md and .json")
    p.add_argument("--load-note", default="", help="what else ran on the machine (printed with the table)")
    asyncio.run(main(p.parse_args()))
