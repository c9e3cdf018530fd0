"""A flood of streaming clients that never read, on the real default model (issue 41, item 4:
"200 non-reading streams free their slots within the stall bound; gateway RSS back within 10%
afterwards").

One `tokenpath serve --model smollm2-135m-instruct --stream-stall-timeout S`, in-process or with
the engine in processes (`--replicas N`). The run:
1. **Warm-up**, so what the server allocates once belongs to the baseline: `--streams` reading
   streams at once (the engine's buffers for a batch this wide with 20 top logprobs), then a few
   non-readers found stalled (the stall path's own allocations). Then past the next periodic heap
   trim: the **before** RSS.
2. **The flood:** `--streams` raw sockets with a tiny receive window each ask for a 1500-token
   stream with 20 top logprobs per token (~1.5 KB of SSE per token) and read nothing
   (tests/reliability/test_slow_readers.py's `non_reader`). Meanwhile a **well-behaved client**
   sends short chat requests one after another and reads them; its successes and latencies are
   counted from the flood's start until every slot is free.
3. **Freed:** the seconds from the last socket opened until every flood stream's audit row is
   closed (its engine and admission slots are free then); each row must say `client_stalled`
   (or 504/429: a stream that never got a slot). And **per stream**, the product's bound: from the
   moment its writes started blocking (the send that waited on its full socket) to the moment
   its generation was closed (the engine's abort sent, applied before the engine's next step, and
   the admission slot given back), from the audit row's timing (`client_stall.freed_s`, stamped
   by `SSEResponse`): p50 / p99 / max against 1.25 x S (the watchdog looks every S / 4).
4. **After:** the sockets are closed, and the gateway's RSS is polled until it is within 10% of
   the flood's start (or two trims and 10 s have passed).
5. **A second flood**, the same: what a leak or a pile-up would move, flood after flood.

`--tenants 2` (the default): the flood comes from tenant A's API key and the well-behaved client
from tenant B's (`tokenpath keys create`), so the fair queue keeps B's short requests ahead of
A's backlog, and the tenant share (admission/share.py) keeps B's slot B's between its requests;
`--tenants 1`: both anonymous (one tenant: B queues behind the flood, as before). B's first
request (B was idle, so it meets the flood holding every slot) and the worst of its later ones
are reported apart.

The server's KV pool is small (`--kv-cache-memory`, 64 MiB by default here): the pool is allocated
untouched and its pages become resident as slots are first used (and stay so, as llama.cpp's
cache is resident from its start), so with the default 512 MiB each flood would touch pages the
last one did not, and the RSS would grow by pool pages, not by anything the flood left behind.
The warm-up's wide batch touches all of a 64 MiB pool. Flood streams that wait in the queue past
their deadline end as 504, and those refused at admission as 429: each still has its row, and
frees what it held.

RSS is the gateway process's own (with `--replicas`, the engines' processes are listed apart:
their KV pages, once touched, stay theirs as llama.cpp's preallocated cache does).

The load generator and the sockets run in this process, pinned to the last core (`taskset`).

    .venv/bin/python benchmarks/slow_reader_flood.py [--streams 200] [--stall 5] [--replicas 0 2] \
        [--kv-cache-memory 64MiB] [--tenants 2]

Writes benchmarks/results/slow_reader_flood.md (one table row per mode) and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
from benchmarks.procs import gauge_sum, port_of, serve, stop_group  # noqa: E402
from tests.reliability.test_slow_readers import STREAM, non_reader, rss_mib  # noqa: E402

from tokenpath.gateway.base import OPEN_STATUS  # noqa: E402
from tokenpath.gateway.store import GatewayStore, resolve_store_location  # noqa: E402
from tokenpath.server.memory import TRIM_INTERVAL_S  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "smollm2-135m-instruct"
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def busy(url: str, admin: str | None) -> float:
    """Requests running and waiting, over every model of /metrics (a flood's requests may sit in any)."""
    return gauge_sum(url, "num_requests_running", auth(admin)) + gauge_sum(url, "num_requests_waiting", auth(admin))


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def create_key(data: Path, tenant: str, *flags: str) -> str:
    """A new API key of `tenant` (`tokenpath keys create`, before the server starts)."""
    out = subprocess.run([str(BIN / "tokenpath"), "keys", "create", "--data-dir", str(data), "--tenant", tenant,
                          *flags], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def engine_rss(gateway_pid: int) -> float:
    """MiB of the gateway's child processes (engines; 0 in-process)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == gateway_pid:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == gateway_pid:
                total += rss_mib(int(pid))
        except (OSError, ValueError, AttributeError):
            continue
    return total


def read_stream(url: str, max_tokens: int, key: str | None) -> int:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**STREAM, "max_tokens": max_tokens},
                      timeout=600, headers=auth(key)) as r:
        for _ in r.iter_bytes():
            pass
        return r.status_code


def stalled_rows(data: Path, ids: list[str]) -> dict[str, tuple[int, str | None, float | None]]:
    """(status, finish_reason, seconds from its writes blocking to its slot freed) of each of `ids`
    (client request ids) that has its closed audit row."""
    store = GatewayStore(resolve_store_location(data))
    try:
        wanted = set(ids)
        return {r.client_request_id: (r.status, r.finish_reason, freed_s(r.timing))
                for r in store.query_audit(limit=None) if r.client_request_id in wanted and r.status != OPEN_STATUS}
    finally:
        store.close()


def freed_s(timing: str | None) -> float | None:
    """The row's `client_stall.freed_s` (api/sse.py), if the stream was found stalled."""
    stall = json.loads(timing).get("client_stall") if timing else None
    return stall.get("freed_s") if isinstance(stall, dict) else None


class WellBehaved(threading.Thread):
    """Short chat requests one after another, each read whole, until stopped."""

    def __init__(self, url: str, key: str | None) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.stop = url, key, threading.Event()
        self.results: list[tuple[int, float]] = []  # (status or 0 for a transport error, seconds)
        self.slowest: tuple[float, str] = (0.0, "")  # (seconds, its Server-Timing): where its time went
        self.slowest_later: tuple[float, str] = (0.0, "")  # the same, of its requests after its first

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=300, headers=auth(self.key)) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                timing = ""
                try:
                    r = http.post("/v1/chat/completions", json=SHORT)
                    code, timing = r.status_code, r.headers.get("server-timing", "")
                except httpx.HTTPError:
                    code = 0
                took = time.monotonic() - t0
                self.results.append((code, took))
                if took > self.slowest[0]:
                    self.slowest = (took, timing)
                if len(self.results) > 1 and took > self.slowest_later[0]:
                    self.slowest_later = (took, timing)


def flood(url: str, port: int, pid: int, data: Path, streams: int, tag: str, keys: dict[str, str | None],
          stall: float) -> dict:
    """One flood (tenant `keys["flood"]`) with the well-behaved client (`keys["steady"]`) beside
    it; then its sockets closed and the RSS polled until within 10% of the flood's start (or two
    heap trims and 10 s have passed)."""
    start, engines_start = rss_mib(pid), engine_rss(pid)
    client = WellBehaved(url, keys["steady"])
    client.start()
    ids = [f"{tag}-{i}-{time.monotonic_ns()}" for i in range(streams)]
    socks = [non_reader(port, rid, api_key=keys["flood"]) for rid in ids]
    opened = time.monotonic()
    peak, engines_peak = start, engines_start
    deadline = opened + 900
    while len(rows := stalled_rows(data, ids)) < streams and time.monotonic() < deadline:
        peak, engines_peak = max(peak, rss_mib(pid)), max(engines_peak, engine_rss(pid))
        time.sleep(0.5)
    closed = time.monotonic() - opened  # every flood stream's row closed: its slots are free
    client.stop.set()
    client.join()
    for s in socks:
        s.close()
    deadline = time.monotonic() + 2 * TRIM_INTERVAL_S + 10
    while (after := rss_mib(pid)) > start * 1.10 and time.monotonic() < deadline:
        time.sleep(1)
    ok = [s for c, s in client.results if c == 200]
    failed = sorted({str(c) for c, _ in client.results if c != 200})
    freed = [f for s, r, f in rows.values() if (s, r) == (499, "client_stalled") and f is not None]
    bound = 1.25 * stall
    return {
        "rows_closed_after_s": round(closed, 1), "rows": len(rows),
        "client_stalled": sum(1 for s, r, _ in rows.values() if (s, r) == (499, "client_stalled")),
        "other_rows": sorted({f"{s} {r}" for s, r, _ in rows.values() if (s, r) != (499, "client_stalled")}),
        "freed_timed": len(freed),
        "freed_p50_s": round(percentile(freed, 50), 2) if freed else None,
        "freed_p99_s": round(percentile(freed, 99), 2) if freed else None,
        "freed_max_s": round(max(freed), 2) if freed else None,
        "freed_over_bound": sum(1 for f in freed if f > bound),
        "still_busy": busy(url, keys["admin"]),
        "well_behaved": len(client.results), "well_behaved_ok": len(ok), "well_behaved_failed": failed,
        "well_behaved_p50_s": round(statistics.median(ok), 2) if ok else None,
        "well_behaved_max_s": round(max(ok), 2) if ok else None,
        "well_behaved_slowest_timing": client.slowest[1],
        # Its first request meets the flood holding every slot (it was idle before): it waits for
        # one of them to end. Its later ones come while it is active (admission/share.py).
        "well_behaved_first_s": round(client.results[0][1], 2) if client.results else None,
        "well_behaved_later_max_s": round(client.slowest_later[0], 2),
        "well_behaved_later_slowest_timing": client.slowest_later[1],
        "rss_start": round(start), "rss_peak": round(peak), "rss_after": round(after),
        "engines_start": round(engines_start), "engines_peak": round(engines_peak),
        "engines_after": round(engine_rss(pid)),
    }


def run_mode(work: Path, replicas: int, streams: int, stall: float, kv: str, tenants: int) -> dict:
    keys: dict[str, str | None] = {"flood": None, "steady": None, "admin": None}
    if tenants == 2:
        keys = {"flood": create_key(work / "data", "flood"), "steady": create_key(work / "data", "steady"),
                "admin": create_key(work / "data", "ops", "--admin")}
    cmd = [str(BIN / "tokenpath"), "serve", "--port", "0", "--model", MODEL, "--log-level", "warning",
           "--data-dir", str(work / "data"), "--stream-stall-timeout", str(stall), "--kv-cache-memory", kv]
    if replicas:
        cmd += ["--replicas", str(replicas)]
    proc, url = serve(cmd, work / "serve.log", new_session=True)
    port = port_of(url)
    try:
        with ThreadPoolExecutor(streams) as pool:  # warm-up: a batch this wide, reading
            codes = list(pool.map(lambda _: read_stream(url, 40, keys["flood"]), range(streams)))
        warm = [f"warm-{i}-{time.monotonic_ns()}" for i in range(4)]
        socks = [non_reader(port, rid, api_key=keys["flood"]) for rid in warm]
        deadline = time.monotonic() + 300
        while len(stalled_rows(work / "data", warm)) < len(warm) and time.monotonic() < deadline:
            time.sleep(1)
        for s in socks:
            s.close()
        time.sleep(TRIM_INTERVAL_S + 5)
        before, engines_before = rss_mib(proc.pid), engine_rss(proc.pid)

        floods = [flood(url, port, proc.pid, work / "data", streams, f"flood{k}", keys, stall) for k in (1, 2)]
        return {"replicas": replicas, "streams": streams, "stall_s": stall, "tenants": tenants,
                "warmup_codes_ok": codes.count(200),
                "rss_before": round(before), "engines_before": round(engines_before), "floods": floods}
    finally:
        stop_group(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--stall", type=float, default=5.0, help="--stream-stall-timeout of the server")
    ap.add_argument("--replicas", type=int, nargs="+", default=[0, 2], help="0: the engine in-process")
    ap.add_argument("--kv-cache-memory", default="64MiB", help="the server's KV pool (see above)")
    ap.add_argument("--tenants", type=int, choices=(1, 2), default=2,
                    help="2: the flood and the well-behaved client are two tenants (API keys); 1: both anonymous")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "slow_reader_flood")
    args = ap.parse_args()
    if "TOKENPATH_PINNED" not in os.environ and len(os.sched_getaffinity(0)) > 1:
        last = str(max(os.sched_getaffinity(0)))
        os.execvpe("taskset", ["taskset", "-c", last, sys.executable, *sys.argv],
                   {**os.environ, "TOKENPATH_PINNED": "1"})
    results = []
    for replicas in args.replicas:
        with tempfile.TemporaryDirectory() as tmp:
            r = run_mode(Path(tmp), replicas, args.streams, args.stall, args.kv_cache_memory, args.tenants)
        print(json.dumps(r), flush=True)
        results.append(r)
    load = os.getloadavg()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.out.with_suffix(".json").write_text(json.dumps({"when": stamp, "load": load, "runs": results}, indent=1))
    tenants = "two tenants: the flood's key and the well-behaved client's" if args.tenants == 2 else "one (anonymous)"
    bound = 1.25 * args.stall
    lines = [f"## {stamp}: {args.streams} non-reading streams, {tenants}", "",
             f"`python benchmarks/slow_reader_flood.py --streams {args.streams} --stall {args.stall:g} "
             f"--replicas {' '.join(map(str, args.replicas))} --kv-cache-memory {args.kv_cache_memory} "
             f"--tenants {args.tenants}` ({platform.machine()}, {os.cpu_count()} cores, load average "
             f"{load[0]:.1f} at the end). Per stream: from its writes blocking (the send that waited on its full "
             f"socket) to its generation closed (the engine's abort sent, admission's slot back), against the "
             f"product's bound 1.25 x the stall setting ({bound:g} s).",
             "", "| engine | flood | rows `client_stalled` (other) | per stream: blocked -> freed p50 / p99 / max s "
             "(over the bound) | all rows closed after | well-behaved ok / sent (p50, max s) "
             "| well-behaved: its first, its later ones' max s "
             "| gateway RSS MiB start / peak / after (after/start) | engines RSS MiB start / peak / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mode = f"`--replicas {r['replicas']}`" if r["replicas"] else "in-process"
        for k, f in enumerate(r["floods"], 1):
            lines.append(
                f"| {mode} | {k} | {f['client_stalled']} of {r['streams']} ({', '.join(f['other_rows']) or 'none'}) "
                f"| {f['freed_p50_s']} / {f['freed_p99_s']} / {f['freed_max_s']} "
                f"({f['freed_over_bound']} of {f['freed_timed']}) "
                f"| {f['rows_closed_after_s']} s | {f['well_behaved_ok']} / {f['well_behaved']} "
                f"({f['well_behaved_p50_s']}, {f['well_behaved_max_s']}; "
                f"failed: {', '.join(f['well_behaved_failed']) or 'none'}) "
                f"| {f['well_behaved_first_s']}, {f['well_behaved_later_max_s']} "
                f"| {f['rss_start']} / {f['rss_peak']} / {f['rss_after']} ({f['rss_after'] / f['rss_start']:.2f}x) "
                f"| {f['engines_start']} / {f['engines_peak']} / {f['engines_after']} |")
    md = args.out.with_suffix(".md")  # a new section after the earlier runs' (kept: they are the history)
    earlier = md.read_text().rstrip("\n") + "\n\n" if md.exists() else "# Non-reading streams (issue 41)\n\n"
    md.write_text(earlier + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
