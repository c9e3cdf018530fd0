"""What running the engine as a Ray actor costs, against a local engine process, in one run.

    python benchmarks/ray_replica.py [--rounds 2] [--concurrency 8] [--num-requests 32]

Both servers are `tokenpath serve` with one engine of the same model outside the gateway
process: `--routing` with `local: 1` (a `tokenpath engine` process on the binary engine link) against
`--ray ADDRESS --replicas 1` (an engine actor on a private Ray head on loopback). Each round runs
both, in alternating order, under the same `tokenpath bench` load; the table reports each
round and the median. Engines get the same torch thread count (TOKENPATH_NUM_THREADS), since Ray
would otherwise set OMP_NUM_THREADS to the actor's num_cpus.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)
    raise RuntimeError(f"{proc.args[:3]} not ready:\n{log.read_text()[-3000:]}")


def start(cmd: list[str], log: Path, env: dict[str, str], pattern: str) -> tuple[subprocess.Popen, re.Match]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, wait_for(log, pattern, proc, 600)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", default="2", help="torch threads per engine (TOKENPATH_NUM_THREADS)")
    ap.add_argument("--out", default=str(RESULTS / "ray_replica"))
    ap.add_argument("--note", default="", help="a line under the table (e.g. what else ran on the box)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out

    work = Path(tempfile.mkdtemp(prefix="tpraybench"))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENPATH_NUM_THREADS": args.threads}
    port = free_port()
    head, _ = start([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                     "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={work / 'ray'}",
                     "--disable-usage-stats"], work / "head.log", env, r"Ray runtime started")
    routes = work / "local.yaml"
    routes.write_text(f"deployments:\n  - name: {args.model}\n    replicas:\n      - local: 1\n")
    servers = {
        "local_process": ["--model", args.model, "--routing", str(routes)],
        "ray_actor": ["--model", args.model, "--ray", f"127.0.0.1:{port}", "--replicas", "1"],
    }
    runs: dict[str, list[dict]] = {k: [] for k in servers}
    try:
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for kind in order:
                proc, m = start([str(BIN / "tokenpath"), "serve", "--port", "0", *servers[kind]],
                                work / f"{kind}-{rnd}.log", env, r"listening on (http://127\.0\.0\.1:\d+/v1)")
                try:
                    out = work / f"{kind}-{rnd}.json"
                    subprocess.run([str(BIN / "tokenpath"), "bench", "--target", f"{kind}={m.group(1)}",
                                    "--model", args.model, "--concurrency", str(args.concurrency),
                                    "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
                                    "--output-len", str(args.output_len), "--warmup", "2", "--no-progress",
                                    "--json", str(out)], env=env, check=True, timeout=1800)
                    summary = json.loads(out.read_text())["runs"][0]["summary"]
                    runs[kind].append(summary)
                    print(f"round {rnd} {kind}: ITL p50 {summary['itl_ms']['median']:.1f} ms, "
                          f"{summary['output_throughput']:.1f} tok/s, failed {summary['failed']}", flush=True)
                finally:
                    stop(proc)
    finally:
        stop(head)
        shutil.rmtree(work, ignore_errors=True)
    write(args, runs)


def write(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    RESULTS.mkdir(exist_ok=True)
    recorded = {**vars(args), "out": Path(args.out).name}  # no machine paths in committed results
    Path(args.out + ".json").write_text(json.dumps({"args": recorded, "runs": runs}, indent=1))
    med = {k: (statistics.median(r["itl_ms"]["median"] for r in v), statistics.median(r["output_throughput"] for r in v),
               statistics.median(r["ttft_ms"]["median"] for r in v)) for k, v in runs.items()}
    (li, lt, lf), (ri, rt, rf) = med["local_process"], med["ray_actor"]
    lines = [f"# Ray actor vs local engine process ({args.model}, c={args.concurrency}, {args.num_requests} requests "
             f"of {args.input_len} in / {args.output_len} out, {args.rounds} rounds alternating)", "",
             "| server | round | ITL p50 (ms) | TTFT p50 (ms) | output tok/s | failed |", "|---|---|---|---|---|---|"]
    for kind, rs in runs.items():
        for i, r in enumerate(rs):
            lines.append(f"| {kind} | {i} | {r['itl_ms']['median']:.1f} | {r['ttft_ms']['median']:.0f} | "
                         f"{r['output_throughput']:.1f} | {r['failed']} |")
    lines += ["", f"Medians: ITL p50 {li:.1f} ms (local) vs {ri:.1f} ms (Ray): **{ri - li:+.1f} ms**; "
              f"throughput {lt:.1f} vs {rt:.1f} tok/s: **{rt / lt:.2f}x**; TTFT p50 {lf:.0f} vs {rf:.0f} ms."]
    if args.note:
        lines += ["", args.note]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
