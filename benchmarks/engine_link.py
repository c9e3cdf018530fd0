"""Engine link vs in-process engine: what does crossing a process boundary cost?

Same run, same requests, same model and engine settings: one in-process engine
(`InProcessReplica`) and one `tokenpath engine` process on the engine link (`EngineLinkReplica`),
each behind a `Deployment` (admission, pick, the replica boundary's Timeline stamps), measured in
alternating rounds (in-process, link, in-process, link...) so drift on a shared machine hits both.
Reported at each concurrency: ITL p50 (gaps between token-bearing deltas as the consumer sees them)
and output tokens/s. Then the gateway's own overhead: the real app (HTTP, tokenizing, admission)
in front of the link replica at concurrency 32, its `gateway` stage p50/p99 from the bodies'
`tokenpath.timing`.

    python benchmarks/engine_link.py --out engine_link
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from routing_common import pct, rand_tokens  # noqa: E402

from tokenpath.protocol import GenerateRequest, SamplingParams  # noqa: E402
from tokenpath.routing.models import Deployment  # noqa: E402
from tokenpath.telemetry.timeline import Timeline  # noqa: E402

RESULTS = Path(__file__).parent / "results"


async def one(dep: Deployment, tokens: list[int], max_tokens: int, tag: str, i: int) -> dict:
    rid = f"{tag}-{i}-{time.monotonic_ns()}"
    req = GenerateRequest(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                          Timeline(rid))
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


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a whole process so far (Linux /proc), all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def level(dep: Deployment, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str,
                engine_pid: int | None = None) -> dict:
    """One round. CPU per output token of this (gateway) process and of the engine process: what
    the link costs in work, which on a loaded machine is steadier than what it costs in time."""
    sem = asyncio.Semaphore(concurrency)
    gw0, eng0 = cpu_s(os.getpid()), cpu_s(engine_pid) if engine_pid else 0.0

    async def run(i: int, p: list[int]) -> dict:
        async with sem:
            return await one(dep, p, max_tokens, tag, i)

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    gw, eng = cpu_s(os.getpid()) - gw0, (cpu_s(engine_pid) - eng0) if engine_pid else 0.0
    gaps = [g for r in rows for g in r["gaps"]]
    delivery = [d for r in rows for d in r["delivery"]]
    tokens = sum(r["tokens"] for r in rows)
    return {"itl_p50_ms": pct(gaps, 50) * 1000, "tok_s": tokens / wall, "wall_s": wall,
            "delivery_p50_ms": pct(delivery, 50) * 1000, "gateway_cpu_ms_per_tok": 1000 * gw / tokens,
            "engine_proc_cpu_ms_per_tok": 1000 * eng / tokens, "loadavg_1m": os.getloadavg()[0]}


async def gateway_overhead(dep: Deployment, n: int, concurrency: int, max_tokens: int) -> dict:
    import httpx
    import uvicorn

    from tokenpath.api.app import create_app
    from tokenpath.routing.models import ModelRouter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(ModelRouter([dep])), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
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

    engine_args = ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
    local_engine = AsyncEngine(cfg)
    await local_engine.start()
    (proc,) = await spawn_engines(1, engine_args=engine_args, max_num_seqs=args.max_num_seqs, nice=0)
    tok = local_engine.tokenizer
    deps = {"in_process": Deployment(local_engine.model_name, "chat", [InProcessReplica(local_engine)],
                                     tokenizer=tok, max_model_len=local_engine.max_model_len),
            "link": Deployment(local_engine.model_name, "chat", [proc.replica], tokenizer=tok,
                               max_model_len=local_engine.max_model_len)}
    rng = random.Random(args.seed)
    results: dict = {"setup": {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args)}}
    try:
        for c, n in ((1, args.requests_c1), (32, args.requests_c32)):
            prompts = [rand_tokens(rng, args.prompt_tokens) for _ in range(n)]
            await level(deps["in_process"], prompts[:2], 4, c, "warm")
            await level(deps["link"], prompts[:2], 4, c, "warm")
            rounds: dict[str, list[dict]] = {"in_process": [], "link": []}
            for _ in range(args.rounds):
                for name in ("in_process", "link"):
                    rounds[name].append(await level(deps[name], prompts, args.max_tokens, c, f"{name}-c{c}",
                                                    engine_pid=proc.proc.pid if name == "link" else None))
            results[f"c{c}"] = rounds
        results["gateway_c32"] = await gateway_overhead(deps["link"], args.requests_c32, 32, args.max_tokens)
    finally:
        await proc.stop()
        await local_engine.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    loads = [r["loadavg_1m"] for c in (1, 32) for rs in results[f"c{c}"].values() for r in rs]
    md = [f"# Engine link vs in-process engine ({platform.machine()}, {os.cpu_count()} CPUs)", "",
          f"SmolLM2-135M, CPU, 1 torch thread per engine, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} output tokens, max_num_seqs {args.max_num_seqs}; {args.rounds} alternating "
          "rounds per level (in-process, link, in-process, link...; median of rounds shown).", "",
          f"**Machine load**: 1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores "
          f"during the rounds{' (' + args.load_note + ')' if args.load_note else ''}. Time figures move with "
          "load; the CPU columns (work per output token) much less.", "",
          "| concurrency | ITL p50 in-process (ms) | ITL p50 link (ms) | link - in-process (ms) "
          "| tok/s in-process | tok/s link | link / in-process | delivery p50 in-process (ms) | delivery p50 link (ms) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for c in (1, 32):
        def med(name: str, key: str, c: int = c) -> float:
            return sorted(r[key] for r in results[f"c{c}"][name])[args.rounds // 2]

        a, b = med("in_process", "itl_p50_ms"), med("link", "itl_p50_ms")
        ta, tb = med("in_process", "tok_s"), med("link", "tok_s")
        da, db = med("in_process", "delivery_p50_ms"), med("link", "delivery_p50_ms")
        md.append(f"| {c} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {ta:.1f} | {tb:.1f} | {tb / ta:.3f} "
                  f"| {da:.2f} | {db:.2f} |")
    md += ["", "Paired per round (each link round right after its in-process round), and CPU per output token "
           "(in-process: the one process; link: gateway + engine process):", "",
           "| concurrency | ITL p50 link / in-process per round | tok/s link / in-process per round "
           "| CPU ms/token in-process | CPU ms/token link (gateway + engine) | link / in-process CPU |",
           "|---|---|---|---|---|---|"]
    for c in (1, 32):
        pairs = list(zip(results[f"c{c}"]["in_process"], results[f"c{c}"]["link"], strict=True))
        itl_r = [b["itl_p50_ms"] / a["itl_p50_ms"] for a, b in pairs]
        tps_r = [b["tok_s"] / a["tok_s"] for a, b in pairs]
        itl = ", ".join(f"{x:.3f}" for x in itl_r) + f" (median **{sorted(itl_r)[len(pairs) // 2]:.3f}**)"
        tps = ", ".join(f"{x:.3f}" for x in tps_r) + f" (median **{sorted(tps_r)[len(pairs) // 2]:.3f}**)"
        cpu_a = sorted(a["gateway_cpu_ms_per_tok"] for a, _ in pairs)[len(pairs) // 2]
        gw_b = sorted(b["gateway_cpu_ms_per_tok"] for _, b in pairs)[len(pairs) // 2]
        eng_b = sorted(b["engine_proc_cpu_ms_per_tok"] for _, b in pairs)[len(pairs) // 2]
        md.append(f"| {c} | {itl} | {tps} | {cpu_a:.2f} | {gw_b + eng_b:.2f} ({gw_b:.2f} + {eng_b:.2f}) "
                  f"| {(gw_b + eng_b) / cpu_a:.3f} |")
    g = results["gateway_c32"]
    md += ["", "Delivery: from the engine's event (first token, finish) to the consumer holding the delta, "
           "both in the gateway's clock (the link's clock offset applied): what crossing the process "
           "boundary adds per delta, apart from how the two processes share the CPU.", "",
           f"Gateway stage (received -> admitted: HTTP parse, tokenize, admission) at concurrency 32 over "
           f"{g['n']} chat requests through the real app in front of the link replica: p50 "
           f"{g['gateway_p50_ms']:.1f} ms, p99 {g['gateway_p99_ms']:.1f} ms (request total p50 {g['total_p50_ms']:.0f} ms)."]
    (RESULTS / f"{args.out}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests-c1", type=int, default=6)
    p.add_argument("--requests-c32", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="engine_link")
    p.add_argument("--load-note", default="", help="what else ran on the machine (printed with the table)")
    asyncio.run(main(p.parse_args()))
