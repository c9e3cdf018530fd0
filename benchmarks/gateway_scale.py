"""One gateway against two, sharing their limits in Redis, under 10x overload of a key's limit.

    python benchmarks/gateway_scale.py [--seconds 20] [--clients 64]

Two simulated replicas (real HTTP servers in this process, no model: the ceiling measured is the
gateways') sit behind either one `tokenpath serve` or two (different ports, one Redis via
scripts/redis.sh, one SQLite key store). A key allows `--rpm` requests per minute; closed-loop
clients ask for ten times what it allows, split evenly over the gateways. Reported: requests
rejected per second (429s), their latency, the admitted count (which must not exceed the limit
however many gateways there are) and the CPU the gateways used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from tokenpath.api.app import create_app
from tokenpath.config import DEFAULT_CHAT_MODEL
from tokenpath.gateway import GatewayStore, Limits
from tokenpath.gateway.admin import create_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the simulated replica is a test double
from benchmarks.procs import serve  # noqa: E402
from tests.simulated_replica import SimulatedConfig, SimulatedReplica  # noqa: E402

from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.server.routing_config import load_tokenizer

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def replica_server(tokenizer: object, name: str) -> str:
    dep = Deployment(name="sim", task="completion", tokenizer=tokenizer, max_model_len=2048,
                     replicas=[SimulatedReplica(name, SimulatedConfig(max_num_seqs=64, token_interval_s=0.005))])
    server = uvicorn.Server(uvicorn.Config(create_app(ModelRouter([dep])), host="127.0.0.1", port=0,
                                           log_level="warning"))
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def start_gateway(work: Path, name: str, routes: Path, redis_url: str) -> tuple[subprocess.Popen, str]:
    return serve([str(BIN / "tokenpath"), "serve", "--port", "0", "--model", DEFAULT_CHAT_MODEL, "--routing",
                  str(routes), "--data-dir", str(work / "data"), "--redis-url", redis_url],
                 work / f"{name}.log", env={**os.environ, "OMP_NUM_THREADS": "1"})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def blast(urls: list[str], secret: str, clients: int, seconds: float) -> dict:
    body = {"model": DEFAULT_CHAT_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    counts: dict[str, int] = {}
    reject_ms: list[float] = []
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits, headers={"Authorization": f"Bearer {secret}"}) as http:
        async def loop(i: int) -> None:
            url = urls[i % len(urls)] + "/v1/chat/completions"
            while time.monotonic() < stop_at:
                t = time.monotonic()
                try:
                    r = await http.post(url, json=body)
                    key = str(r.status_code)
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                counts[key] = counts.get(key, 0) + 1
                if key == "429":
                    reject_ms.append(1000 * (time.monotonic() - t))

        await asyncio.gather(*(loop(i) for i in range(clients)))
    reject_ms.sort()
    return {"counts": counts, "rejected_per_s": counts.get("429", 0) / seconds,
            "reject_p50_ms": reject_ms[len(reject_ms) // 2] if reject_ms else None,
            "reject_p99_ms": reject_ms[int(len(reject_ms) * 0.99)] if reject_ms else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rpm", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    work = Path(tempfile.mkdtemp(prefix="tpgwbench"))
    env = {**os.environ, "TOKENPATH_REDIS_DIR": str(work / "redis")}
    redis_url = subprocess.run(["bash", str(ROOT / "scripts" / "redis.sh"), "start"], env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
    tokenizer = load_tokenizer(DEFAULT_CHAT_MODEL)
    urls = [replica_server(tokenizer, f"sim{i}") for i in range(2)]
    routes = work / "routes.yaml"
    routes.write_text(f"deployments:\n  - name: {DEFAULT_CHAT_MODEL}\n    replicas:\n" + "".join(
        f"      - url: {u}\n        model: sim\n        max_num_seqs: 64\n" for u in urls))
    gateways = [start_gateway(work, f"gw{i}", routes, redis_url) for i in range(2)]
    results: dict[str, list[dict]] = {"1 gateway": [], "2 gateways": []}
    try:
        for rnd in range(args.rounds):
            order = list(results) if rnd % 2 == 0 else list(reversed(results))
            for setup in order:
                used = gateways[:1] if setup == "1 gateway" else gateways
                store = GatewayStore(work / "data" / "gateway.sqlite3")
                secret, _ = create_key(store, f"t{rnd}{len(used)}", limits=Limits(rpm=args.rpm))
                store.close()
                cpu0 = [cpu_seconds(p.pid) for p, _ in used]
                r = asyncio.run(blast([u for _, u in used], secret, args.clients, args.seconds))
                r["gateway_cpu_s"] = round(sum(cpu_seconds(p.pid) for p, _ in used) - sum(cpu0), 2)
                results[setup].append(r)
                print(setup, rnd, json.dumps(r), flush=True)
    finally:
        for proc, _ in gateways:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        subprocess.run(["bash", str(ROOT / "scripts" / "redis.sh"), "stop"], env=env, capture_output=True)
    write(args, results)


def write(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_scale.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    lines = [f"# One vs two gateways sharing limits in Redis ({args.clients} closed-loop clients for "
             f"{args.seconds:.0f} s against a key of {args.rpm} RPM, 2 simulated replicas)", "",
             "| setup | round | admitted (200) | rejected/s (429) | 429 p50 ms | 429 p99 ms | other | gateway CPU s |",
             "|---|---|---|---|---|---|---|---|"]
    for setup, rs in results.items():
        for i, r in enumerate(rs):
            c = r["counts"]
            other = {k: v for k, v in c.items() if k not in ("200", "429")}
            lines.append(f"| {setup} | {i} | {c.get('200', 0)} | {r['rejected_per_s']:.0f} | {r['reject_p50_ms']:.1f} | "
                         f"{r['reject_p99_ms']:.1f} | {other or '-'} | {r['gateway_cpu_s']} |")
    one = sum(r["rejected_per_s"] for r in results["1 gateway"]) / len(results["1 gateway"])
    two = sum(r["rejected_per_s"] for r in results["2 gateways"]) / len(results["2 gateways"])
    lines += ["", f"Mean rejections per second: {one:.0f} (1 gateway) vs {two:.0f} (2 gateways): **{two / one:.2f}x**."]
    (RESULTS / "gateway_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
