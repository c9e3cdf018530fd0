"""Soak: mixed traffic against `tokenpath serve --replicas 2` for a long time (issue 10).

What a production week does to a server, compressed: streams, non-streaming requests, clients that
leave mid-stream, embeddings, bursts that must be answered 429, and one SIGKILL of an engine
process part-way through. The server runs exactly as a user starts it (the console script, its own
data dir, free loopback port); the load generator is this process.

Reported (benchmarks/results/soak.md and .json):
- RSS of every process in the server's tree, sampled every 10 s and averaged per minute, and per
  process the drift of the mean over the last 10 minutes from minute 5, after warm-up (goal:
  < 5%), besides end vs minute 5 and end vs minute 1;
- KV cache usage and running/waiting requests once traffic stops (goal: nothing left in use);
- responses by status, with 5xx counted apart inside the kill window (goal: zero 5xx outside it);
- TTFT p50/p99 of streams per window (5 minutes by default).

    .venv/bin/python benchmarks/soak.py                      # 30 minutes, one engine kill at minute 10
    .venv/bin/python benchmarks/soak.py --minutes 4 --window 1 --kill-at 1.5   # a short run

With `--faults` (root: it mounts a tmpfs), every fault of issue 23 in one run instead, under steady
load, a few minutes (`benchmarks/soak_faults.py`: a frozen engine, a full disk under the audit
store, a flood on an engine's port, browser probes, `kill -9` of the gateway, shutdown with an
engine frozen), reporting requests and audit rows lost, time to eject and to recover, rows spooled:

    sudo .venv/bin/python benchmarks/soak.py --faults         # results/soak_faults.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

RESULTS = Path(__file__).resolve().parent / "results"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
CHAT, EMBED = "smollm2-135m-instruct", "all-minilm-l6-v2"
WORDS = ["river", "stone", "light", "garden", "music", "paper", "window", "silver", "morning", "engine", "quiet", "yellow", "market"]
RSS_EVERY_S = 10.0  # RSS sampling period; the report has one row a minute (that minute's mean)
KILL_WINDOW_S = 35.0  # after the kill: restart (< 30 s) plus requests that were in flight


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kill_window_5xx: int = 0
    other_5xx: list[str] = field(default_factory=list)
    ttft: dict[int, list[float]] = field(default_factory=dict)  # window index -> seconds
    kill_at: float | None = None

    def record(self, status: int, started: float, t0: float, detail: str = "") -> None:
        self.statuses[status] += 1
        if status >= 500:
            # In the kill window: in flight when the engine died, or started while it restarted.
            ended = time.monotonic()
            if self.kill_at is not None and ended >= self.kill_at and started <= self.kill_at + KILL_WINDOW_S:
                self.kill_window_5xx += 1
            else:
                self.other_5xx.append(f"{status} at {started - t0:.0f}s: {detail[:200]}")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


async def stream_chat(client: httpx.AsyncClient, rng: random.Random, tally: Tally, t0: float, window_s: float,
                      leave_early: bool) -> None:
    body = {"model": CHAT, "stream": True, "max_tokens": rng.randint(8, 64), "temperature": rng.random(),
            "messages": [{"role": "user", "content": prompt(rng)}]}
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.record(r.status_code, started, t0, r.text)
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if chunks == 0:
                    tally.ttft.setdefault(int((started - t0) // window_s), []).append(time.monotonic() - started)
                chunks += 1
                if '"error"' in line:
                    tally.record(599, started, t0, line)
                    return
                if leave_early and chunks >= 3:
                    tally.record(499, started, t0)  # the client left: no status of its own
                    return
            tally.record(200, started, t0)
    except httpx.HTTPError as exc:
        tally.record(598, started, t0, repr(exc))


async def plain(client: httpx.AsyncClient, rng: random.Random, tally: Tally, t0: float, embed: bool) -> None:
    started = time.monotonic()
    if embed:
        path, body = "/v1/embeddings", {"model": EMBED, "input": [prompt(rng) for _ in range(rng.randint(1, 8))]}
    else:
        path, body = "/v1/completions", {"model": CHAT, "prompt": prompt(rng), "max_tokens": rng.randint(4, 32)}
    try:
        r = await client.post(path, json=body)
        tally.record(r.status_code, started, t0, r.text)
    except httpx.HTTPError as exc:
        tally.record(598, started, t0, repr(exc))


async def burst(client: httpx.AsyncClient, rng: random.Random, tally: Tally, t0: float, size: int) -> None:
    """More requests at once than the deployment admits: the excess must be 429, not 5xx."""
    await asyncio.gather(*(plain(client, rng, tally, t0, embed=False) for _ in range(size)))


def tree_rss(pid: int) -> dict[str, float]:
    """MiB: the gateway process, and its children together (engine pids change at a restart)."""
    out: dict = {"gateway": 0.0, "engines": 0.0, "num_engines": 0, "per_pid": {}}
    try:
        root = psutil.Process(pid)
        out["gateway"] = root.memory_info().rss / 2**20
        for p in root.children(recursive=True):
            mib = p.memory_info().rss / 2**20
            out["engines"] += mib
            out["num_engines"] += 1
            out["per_pid"][str(p.pid)] = round(mib, 1)
    except psutil.Error:
        pass
    return out


def mean_rss(samples: list[dict]) -> dict:
    """One row from several `tree_rss` samples: means (a process missing from some samples is
    averaged over those it was in), and the gateway's max. The gateway's heap is trimmed once a
    minute, so one sample a minute would land anywhere on that saw-tooth."""
    pids: dict[str, list[float]] = {}
    for smp in samples:
        for pid, mib in smp["per_pid"].items():
            pids.setdefault(pid, []).append(mib)
    return {"gateway": round(sum(x["gateway"] for x in samples) / len(samples), 1),
            "gateway_max": round(max(x["gateway"] for x in samples), 1),
            "engines": round(sum(x["engines"] for x in samples) / len(samples), 1),
            "num_engines": samples[-1]["num_engines"], "samples": len(samples),
            "per_pid": {pid: round(sum(v) / len(v), 1) for pid, v in pids.items()}}


def engine_pids(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)
                if "engine" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def read_gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        vals = [float(v) for v in re.findall(rf"^tokenpath:{name}\{{[^}}]*\}} (\S+)$", text, re.M)]
        out[name] = max(vals) if vals else float("nan")
    return out


async def run(args: argparse.Namespace) -> dict:
    data = Path(tempfile.mkdtemp(prefix="tokenpath-soak-"))
    log = data / "server.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(data / "data")}
    with log.open("wb") as out:
        proc = subprocess.Popen([TOKENPATH, "serve", "--port", "0", "--replicas", str(args.replicas),
                                 "--num-kv-blocks", str(args.kv_blocks)], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        port = None
        for _ in range(1200):
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
            if m:
                port = int(m.group(1))
                break
            if proc.poll() is not None:
                raise RuntimeError(log.read_text())
            await asyncio.sleep(0.5)
        if port is None:
            raise RuntimeError("server did not start")
        return await drive(args, proc, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def drive(args: argparse.Namespace, proc: subprocess.Popen, url: str) -> dict:
    rng = random.Random(args.seed)
    tally = Tally()
    rss: list[dict] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    kill_at = t0 + args.kill_at * 60 if args.kill_at >= 0 else None
    next_rss = t0
    window: list[dict] = []
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_rss:  # every RSS_EVERY_S; one row a minute holds that minute's mean
                window.append(tree_rss(proc.pid))
                next_rss += RSS_EVERY_S
                if len(window) * RSS_EVERY_S >= 60 or not rss:
                    rss.append({"minute": round((now - t0) / 60, 1), **mean_rss(window)})
                    window.clear()
            if kill_at is not None and now >= kill_at and tally.kill_at is None:
                pids = engine_pids(proc.pid)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                tally.kill_at = now
            while len(tasks) < args.concurrency:
                roll = rng.random()
                if roll < 0.45:
                    coro = stream_chat(client, rng, tally, t0, args.window * 60, leave_early=False)
                elif roll < 0.65:
                    coro = stream_chat(client, rng, tally, t0, args.window * 60, leave_early=True)
                elif roll < 0.80:
                    coro = plain(client, rng, tally, t0, embed=True)
                elif roll < 0.98:
                    coro = plain(client, rng, tally, t0, embed=False)
                else:
                    coro = burst(client, rng, tally, t0, args.burst)
                task = asyncio.create_task(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(2.0)
        idle = read_gauges((await client.get("/metrics")).text)
        rss.append({"minute": round((time.monotonic() - t0) / 60, 1), **tree_rss(proc.pid)})
    return summarize(args, tally, rss, idle)


def drift(new: float, ref: float) -> float | None:
    return round(100 * (new - ref) / ref, 1) if ref > 0 else None


def at_minute(series: list[tuple[float, float]], minute: float) -> float:
    """The sample nearest to `minute` (minutes since that process's first sample)."""
    return min(series, key=lambda mr: abs(mr[0] - minute))[1]


def process_drift(rss: list[dict], late_min: float = 10.0) -> list[dict]:
    """Per process (the gateway, then each engine pid): RSS at its minute 1 and 5 (after warm-up)
    and at the end, the mean over the run's last `late_min` minutes, and the drift of the end and
    of that late mean from minute 5 (the figure held to < 5%) and of the end from minute 1. An
    engine's minutes count from its own first sample: the one restarted after the kill warms up
    anew; the killed one's series ends at the kill."""
    series: dict[str, list[tuple[float, float]]] = {"gateway": [(r["minute"], r["gateway"]) for r in rss]}
    for r in rss:
        for pid, mib in r.get("per_pid", {}).items():
            series.setdefault(f"engine pid {pid}", []).append((r["minute"], mib))
    end_minute = rss[-1]["minute"]
    out = []
    for name, pts in series.items():
        born, last = pts[0][0], pts[-1][0]
        rel = [(m - born, v) for m, v in pts]
        m1, m5, end = at_minute(rel, 1), at_minute(rel, 5), pts[-1][1]
        late = [v for m, v in pts if m >= end_minute - late_min and m - born >= 5]
        late_mean = sum(late) / len(late) if late else float("nan")
        out.append({"process": name, "from_min": born, "to_min": last, "min1": round(m1), "min5": round(m5),
                    "end": round(end), "late_mean": round(late_mean) if late else None,
                    "max": round(max(v for _, v in pts)),
                    "drift_end_vs_min5_pct": drift(end, m5), "drift_late_vs_min5_pct": drift(late_mean, m5) if late else None,
                    "drift_end_vs_min1_pct": drift(end, m1), "alive_at_end": last == end_minute})
    return out


def summarize(args: argparse.Namespace, tally: Tally, rss: list[dict], idle: dict[str, float]) -> dict:
    ttft = {}
    for w, vals in sorted(tally.ttft.items()):
        vals.sort()
        ttft[f"{w * args.window}-{(w + 1) * args.window} min"] = {
            "n": len(vals), "p50_s": round(vals[len(vals) // 2], 3),
            "p99_s": round(vals[min(len(vals) - 1, int(len(vals) * 0.99))], 3)}
    return {"minutes": args.minutes, "replicas": args.replicas, "concurrency": args.concurrency,
            "statuses": dict(sorted(tally.statuses.items())), "kill_window_5xx": tally.kill_window_5xx,
            "other_5xx": tally.other_5xx[:20], "num_other_5xx": len(tally.other_5xx),
            "idle": idle, "rss_mib": rss, "processes": process_drift(rss), "ttft": ttft}


def write(res: dict, out: Path, note: str = "") -> None:
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    procs = res["processes"]
    def worst(key: str) -> float:
        return max((abs(p[key]) for p in procs if p["alive_at_end"] and p[key] is not None), default=float("nan"))

    lines = [f"# Soak: {res['minutes']} min of mixed traffic, `serve --replicas {res['replicas']}`, "
             f"{res['concurrency']} clients, one engine SIGKILL", "", *([note, ""] if note else []),
             "| goal | result |", "|---|---|",
             f"| RSS drift < 5% per process, after warm-up | worst {worst('drift_late_vs_min5_pct')}% as the mean "
             f"of the last 10 min vs minute 5; worst {worst('drift_end_vs_min5_pct')}% as the end vs minute 5 "
             "(per process below) |",
             f"| nothing in use when idle (no leaked KV blocks) | KV usage {res['idle']['kv_cache_usage_perc']}, "
             f"running {res['idle']['num_requests_running']}, waiting {res['idle']['num_requests_waiting']} |",
             f"| zero 5xx outside the kill window | {res['num_other_5xx']} (inside it: {res['kill_window_5xx']}) |",
             "", f"Responses by status (499 = the client left on purpose): {res['statuses']}", "",
             "RSS per process (MiB). Minutes count from the process's own first sample (the engine restarted "
             "after the kill warms up anew); drift = change in %.", "",
             "| process | sampled (min) | min 1 | min 5 | end | mean last 10 min | max | end vs min 5 "
             "| last-10-min mean vs min 5 | end vs min 1 |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['process']}{'' if p['alive_at_end'] else ' (killed)'} | {p['from_min']}-{p['to_min']} | "
              f"{p['min1']} | {p['min5']} | {p['end']} | {p['late_mean']} | {p['max']} | "
              f"{p['drift_end_vs_min5_pct']} | {p['drift_late_vs_min5_pct']} | {p['drift_end_vs_min1_pct']} |"
              for p in procs]
    lines += ["", "| window | streams | TTFT p50 | TTFT p99 |", "|---|---|---|---|"]
    lines += [f"| {w} | {v['n']} | {v['p50_s']} s | {v['p99_s']} s |" for w, v in res["ttft"].items()]
    lines += ["", "| minute | gateway RSS (MiB) | engines RSS together (MiB) | engine processes |", "|---|---|---|---|"]
    lines += [f"| {r['minute']} | {r['gateway']:.0f} | {r['engines']:.0f} | {r['num_engines']} |"
              for r in res["rss_mib"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--window", type=float, default=5.0, help="minutes per TTFT window")
    ap.add_argument("--kill-at", type=float, default=10.0, help="minute of the engine SIGKILL (-1: none)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=96, help="small, so preemption happens")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--burst", type=int, default=48)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="soak")
    ap.add_argument("--note", default="", help="a line for the top of the report (what changed, the machine)")
    ap.add_argument("--rerender", metavar="JSON", help="rewrite the report from an earlier run's .json")
    f = ap.add_argument_group("--faults: every fault of issue 23 in one run (benchmarks/soak_faults.py)")
    f.add_argument("--faults", action="store_true")
    f.add_argument("--model", default=CHAT)
    f.add_argument("--clients", type=int, default=6)
    f.add_argument("--warm", type=float, default=20.0, help="seconds of load before the first fault")
    f.add_argument("--gap", type=float, default=8.0, help="seconds of load between faults")
    f.add_argument("--freeze", type=float, default=30.0, help="seconds engine-0 stays SIGSTOPped")
    f.add_argument("--disk-full", type=float, default=30.0, help="seconds the store's disk stays full")
    f.add_argument("--stall-timeout", type=float, default=None, help="serve's bound (default: serve's own)")
    f.add_argument("--shutdown-timeout", type=float, default=5.0)
    args = ap.parse_args()
    if args.faults:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from soak_faults import run_faults

        args.out = "soak_faults" if args.out == "soak" else args.out
        res = run_faults(args)
        print(json.dumps({k: v for k, v in res.items() if k != "command"}, indent=2))
        return
    if args.rerender:
        res = json.loads(Path(args.rerender).read_text())
        res["processes"] = process_drift(res["rss_mib"])
        write(res, RESULTS / args.out, args.note)
        return
    args.seed = args.seed if args.seed is not None else random.randrange(2**31)
    res = asyncio.run(run(args))
    res["seed"] = args.seed
    write(res, RESULTS / args.out, args.note)
    print(json.dumps({k: res[k] for k in ("statuses", "kill_window_5xx", "num_other_5xx", "idle", "processes")}))


if __name__ == "__main__":
    main()
