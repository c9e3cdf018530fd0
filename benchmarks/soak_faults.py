"""Every fault of issue 23 in one run, under steady load: `benchmarks/soak.py --faults` runs this.

One `tokenpath serve --replicas 2` (the gateway and two engine processes, as a user starts them),
its audit store a SQLite file on a small tmpfs of its own (root: the disk can be filled), and
`--clients` closed-loop clients (half streaming), each request with its own `x-request-id`.
In order, with the load running throughout:

1. **Engine frozen:** engine-0 SIGSTOPped for `--freeze` s, then SIGCONT. `/health` is polled
   every 50 ms: time to eject, time to recover. Requests sent during the freeze (share that
   succeeded), the worst wait beyond normal of any request that overlapped it, and requests the
   frozen engine received after the stall bound (from its own log: it logs every request it queues).
2. **Disk full:** the store's tmpfs filled to the last byte for `--disk-full` s, then freed: time to
   `/health` degraded, the most rows spooled at once, rows dropped, time to drain after the repair.
3. **Engine port:** 8 connections each sending 63 MiB before any hello, to engine-1's port: its RSS
   growth (target < 10 MiB), and the link still serving.
4. **Browser safety:** a foreign `Host`, a cross-site body-less POST, `/dashboard`'s headers.
5. **`kill -9` of the gateway** under load, then a restart on the same data dir and store: every
   request that was admitted has a closed audit row after it (`gateway_crash` for those it cut).
6. **Shutdown** with an engine frozen: SIGTERM to exit, against `--shutdown-timeout` plus 2 s.

Then rows lost over the whole run: requests that were admitted (their 200 came back, whether the
stream then finished or was cut by the kill) with no closed audit row. Results: benchmarks/results/soak_faults.md and .json,
with the machine's load average before and after (a loaded machine stretches every latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
BIG = 63 * 1024 * 1024
VICTIM, OTHER = "engine-0", "engine-1"


@dataclass
class Run:
    records: list[dict] = field(default_factory=list)  # one per request: rid, start, dur, status, ok
    health: list[tuple[float, int, bool, bool, str, int]] = field(default_factory=list)
    # (t, http status, victim healthy, other healthy, audit state, spool rows)
    stop: bool = False
    paused: bool = False  # while the gateway is down and restarting


def pct(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


class Gateway:
    """The server under test: started, killed, restarted on the same data dir and store."""

    def __init__(self, tmp: Path, store: str, args) -> None:  # noqa: ANN001 - argparse namespace
        self.tmp, self.store, self.args = tmp, store, args
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.tmp / f"server-{self.starts}.log"
        env = {**os.environ, "TOKENPATH_DATA_DIR": str(self.tmp / "data")}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [TOKENPATH, "serve", "--port", "0", "--model", self.args.model, "--replicas", "2",
                 "--stall-timeout", str(self.args.stall_timeout), "--shutdown-timeout", str(self.args.shutdown_timeout),
                 "--database-url", self.store, "--log-format", "json"], stdout=out, stderr=subprocess.STDOUT, env=env)
        self.log = log
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (http://\S+)/v1", log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        self.url = m.group(1)

    def engine_log(self, name: str) -> str:
        return (self.tmp / "data" / "logs" / "engines" / f"{name}.log").read_text(errors="replace")

    def engine_pid(self, name: str) -> int:
        return int(re.findall(r"started \(pid (\d+)\)", self.engine_log(name))[-1])

    def events(self, event: str) -> list[dict]:
        out = []
        for log in sorted(self.tmp.glob("server-*.log")):
            out += [json.loads(x) for x in log.read_text(errors="replace").splitlines() if f'"event":"{event}"' in x]
        return out


async def client_loop(run: Run, gw: Gateway, i: int, model: str) -> None:
    n = 0
    async with httpx.AsyncClient(timeout=120) as c:
        while not run.stop:
            if run.paused:
                await asyncio.sleep(0.1)
                continue
            n += 1
            rid, stream = f"c{i}-{n}", n % 2 == 0
            body = {"model": model, "messages": [{"role": "user", "content": f"Client {i} request {n}: say hi."}],
                    "max_tokens": 16, "temperature": 0, "stream": stream}
            rec = {"rid": rid, "start": time.monotonic(), "status": 0, "ok": False, "stream": stream}
            try:
                async with c.stream("POST", f"{gw.url}/v1/chat/completions", json=body,
                                    headers={"x-request-id": rid}) as r:
                    rec["status"] = r.status_code
                    text = (await r.aread()).decode()
                    rec["ok"] = r.status_code == 200 and (not stream or ('"error"' not in text and "[DONE]" in text))
            except httpx.HTTPError as exc:
                rec["error"] = type(exc).__name__
            rec["dur"] = time.monotonic() - rec["start"]
            run.records.append(rec)
            if not rec["ok"]:
                await asyncio.sleep(0.2)  # (a refused client backs off a little, as a real one would)


async def watch(run: Run, gw: Gateway) -> None:
    async with httpx.AsyncClient(timeout=2) as c:
        while not run.stop:
            try:
                r = await c.get(f"{gw.url}/health")
                h = r.json()
                reps = {k: v for d in h["replicas"].values() for k, v in d.items()}
                audit = h.get("audit", {})
                run.health.append((time.monotonic(), r.status_code, reps.get(VICTIM, {}).get("healthy", True),
                                   reps.get(OTHER, {}).get("healthy", True), audit.get("state", "ok"),
                                   int(audit.get("spool_rows", 0))))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)


def first(health: list, after: float, cond) -> float | None:  # noqa: ANN001
    return next((round(h[0] - after, 3) for h in health if h[0] >= after and cond(h)), None)


async def freeze_phase(run: Run, gw: Gateway, a) -> dict:  # noqa: ANN001
    pid = gw.engine_pid(VICTIM)
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        await asyncio.sleep(a.freeze)
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    await asyncio.sleep(a.gap)
    base = [r["dur"] for r in run.records if r["start"] < frozen - 1 and r["ok"]]
    normal = statistics.median(base) if base else 0.0
    during = [r for r in run.records if frozen <= r["start"] < resumed]
    overlapping = [r for r in run.records if r["start"] < resumed and r["start"] + r["dur"] > frozen]
    late_ids = {r["rid"] for r in during if r["start"] > frozen + a.stall_timeout + 0.5}
    received = set(re.findall(r"request (c\d+-\d+) queued", gw.engine_log(VICTIM)))
    return {
        "freeze_s": a.freeze, "stall_timeout_s": a.stall_timeout,
        "time_to_eject_s": first(run.health, frozen, lambda h: not h[2]),
        "time_to_recover_s": first(run.health, resumed, lambda h: h[2]),
        "ejections_logged": sum(e.get("reason") == "stalled" and e.get("replica") == VICTIM
                                for e in gw.events("replica_ejected")),
        "sent_during_freeze": len(during), "succeeded_during_freeze": sum(r["ok"] for r in during),
        "success_during_freeze": round(sum(r["ok"] for r in during) / max(1, len(during)), 4),
        "lost_overlapping_freeze": sum(not r["ok"] for r in overlapping),
        "normal_p50_s": round(normal, 3), "normal_p99_s": pct(base, 0.99),
        "worst_extra_wait_s": round(max((r["dur"] for r in overlapping), default=normal) - normal, 3),
        "routed_to_frozen_after_bound": len(late_ids & received),
    }


async def disk_phase(run: Run, gw: Gateway, a, mnt: Path) -> dict:  # noqa: ANN001
    filler = mnt / "filler"

    def fill() -> None:
        with filler.open("wb", buffering=0) as f:
            for chunk in (1 << 16, 512, 1):
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    pass

    t_fail = time.monotonic()
    await asyncio.to_thread(fill)
    await asyncio.sleep(a.disk_full)
    t_repair = time.monotonic()
    filler.unlink()
    deadline = t_repair + 120
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        last = run.health[-1] if run.health else None
        if last and last[0] > t_repair + 0.5 and last[4] == "ok" and last[5] == 0:
            break
    spool = [h[5] for h in run.health if t_fail <= h[0]]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    counts = {k: int(float(m.group(1))) for k in ("spooled", "dropped")
              if (m := re.search(rf"^tokenpath:audit_rows_{k}_total (\S+)$", metrics, re.M))}
    return {"disk_full_s": a.disk_full, "time_to_degraded_s": first(run.health, t_fail, lambda h: h[4] != "ok"),
            "max_spool_rows": max(spool, default=0), "rows_spooled_total": counts.get("spooled"),
            "rows_dropped_total": counts.get("dropped"),
            "drained_after_repair_s": first(run.health, t_repair + 0.5, lambda h: h[4] == "ok" and h[5] == 0)}


def _garbage(port: int) -> None:
    chunk = b"\xa5" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(struct.pack(">I", BIG))
            for _ in range(BIG // len(chunk)):
                s.sendall(chunk)
    except OSError:
        pass  # refused and closed under us: what should happen


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def port_phase(run: Run, gw: Gateway) -> dict:
    import psutil

    pid = gw.engine_pid(OTHER)
    port = next(c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN)
    before, peak = rss_kib(pid), 0
    threads = [threading.Thread(target=_garbage, args=(port,), daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.05)
    served = len(run.records)
    await asyncio.sleep(3)
    return {"engine_rss_growth_mib": round((peak - before) / 1024, 1),
            "requests_served_meanwhile": len(run.records) - served}


async def browser_phase(gw: Gateway) -> dict:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        host = await c.get("/v1/models", headers={"Host": "evil.example"})
        xsite = await c.post("/reset_prefix_cache", content=b"", headers={"Origin": "http://evil.example",
                                                                           "Content-Type": "text/plain"})
        dash = await c.get("/dashboard")
    return {"foreign_host_status": host.status_code, "cross_site_post_status": xsite.status_code,
            "dashboard_x_frame_options": dash.headers.get("x-frame-options"),
            "dashboard_csp": bool(dash.headers.get("content-security-policy"))}


async def crash_phase(run: Run, gw: Gateway, a) -> dict:  # noqa: ANN001
    assert gw.proc is not None
    killed = time.monotonic()
    gw.proc.kill()  # SIGKILL: no drain, no row closed by this process
    gw.proc.wait(30)
    run.paused = True
    await asyncio.sleep(1)
    await asyncio.to_thread(gw.start)
    up = time.monotonic()
    run.paused = False
    return {"restart_to_serving_s": round(up - killed, 1)}


async def drive(a, gw: Gateway, mnt: Path) -> dict:  # noqa: ANN001
    run = Run()
    model = httpx.get(f"{gw.url}/v1/models", timeout=30).json()["data"][0]["id"]
    tasks = [asyncio.create_task(client_loop(run, gw, i, model)) for i in range(a.clients)]
    tasks.append(asyncio.create_task(watch(run, gw)))
    out: dict = {}
    try:
        await asyncio.sleep(a.warm)
        out["engine_frozen"] = await freeze_phase(run, gw, a)
        out["disk_full"] = await disk_phase(run, gw, a, mnt)
        out["engine_port"] = await port_phase(run, gw)
        out["browser"] = await browser_phase(gw)
        await asyncio.sleep(a.gap)
        out["gateway_kill9"] = await crash_phase(run, gw, a)
        await asyncio.sleep(a.gap)
    finally:
        run.stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
    # Shutdown with an engine frozen.
    pid = gw.engine_pid(VICTIM)
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    assert gw.proc is not None
    gw.proc.send_signal(signal.SIGTERM)
    try:
        code = gw.proc.wait(120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the gateway killed it on its way out)
            os.kill(pid, signal.SIGCONT)
    out["shutdown"] = {"timeout_s": a.shutdown_timeout, "took_s": round(time.monotonic() - start, 2), "exit": code}
    out["requests"] = {"sent": len(run.records), "ok": sum(r["ok"] for r in run.records),
                       "statuses": dict(sorted(_count(str(r["status"]) for r in run.records).items()))}
    out["audit_rows_lost"] = rows_lost(gw.store, run.records)
    return out


def _count(xs) -> dict:  # noqa: ANN001
    d: dict = {}
    for x in xs:
        d[x] = d.get(x, 0) + 1
    return d


def rows_lost(store: str, records: list[dict]) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from tokenpath.gateway import GatewayStore
    from tokenpath.gateway.base import OPEN_STATUS

    s = GatewayStore(store)
    try:
        rows = {r.request_id: r for r in s.query_audit(limit=None)}
    finally:
        s.close()
    admitted = {r["rid"] for r in records if r["status"] == 200}  # (a 200's headers: admitted for sure)
    refused = {r["rid"] for r in records if r["status"] not in (0, 200)}
    closed = {rid for rid, r in rows.items() if r.status != OPEN_STATUS}
    return {"requests_admitted": len(admitted), "without_closed_row": len(admitted - closed),
            "examples": sorted(admitted - closed)[:10], "refused": len(refused),
            "refused_without_row": len(refused - closed), "open_rows_left": len(set(rows) - closed),
            "closed_as_gateway_crash": sum(r.finish_reason == "gateway_crash" for r in rows.values())}


def write(res: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    f, d, p, b, k, s = (res[x] for x in ("engine_frozen", "disk_full", "engine_port", "browser", "gateway_kill9",
                                         "shutdown"))
    lost = res["audit_rows_lost"]
    lines = [
        "# Fault soak (issue 23): every fault in one run, under load", "",
        f"`{res['command']}` on {res['machine']}. Load average (1/5/15 min) before {res['load_before']}, "
        f"after {res['load_after']}: a loaded machine stretches every latency here.", "",
        f"Requests: {res['requests']['sent']} sent, {res['requests']['ok']} succeeded; statuses "
        f"{res['requests']['statuses']} (0 = no response: cut by the gateway's kill -9).", "",
        "| fault | target | result |", "|---|---|---|",
        f"| engine-0 SIGSTOPped {f['freeze_s']:g} s (stall bound {f['stall_timeout_s']:g} s) | ejected, "
        f"logged | ejected after {f['time_to_eject_s']} s, {f['ejections_logged']} `replica_ejected` (stalled); "
        f"recovered {f['time_to_recover_s']} s after SIGCONT |",
        f"| | none routed to it after the bound | {f['routed_to_frozen_after_bound']} |",
        f"| | worst extra wait <= 5 s | {f['worst_extra_wait_s']} s beyond the normal p50 {f['normal_p50_s']} s "
        f"(p99 {f['normal_p99_s']} s) |",
        f"| | >= 99% of those sent during it succeed | {f['succeeded_during_freeze']}/{f['sent_during_freeze']} "
        f"({100 * f['success_during_freeze']:.1f}%); {f['lost_overlapping_freeze']} failed of all that overlapped it |",
        f"| store's disk full {d['disk_full_s']:g} s | `/health` degraded within 1 s | {d['time_to_degraded_s']} s |",
        f"| | 0 rows lost | {d['rows_spooled_total']} spooled (at most {d['max_spool_rows']} at once), "
        f"{d['rows_dropped_total']} dropped, drained {d['drained_after_repair_s']} s after the repair |",
        f"| 8 x 63 MiB before the hello, engine-1's port | RSS < 10 MiB more | +{p['engine_rss_growth_mib']} MiB; "
        f"{p['requests_served_meanwhile']} requests served meanwhile |",
        f"| browser: foreign Host; cross-site POST; /dashboard | refused; refused; framing denied | "
        f"{b['foreign_host_status']}; {b['cross_site_post_status']}; X-Frame-Options {b['dashboard_x_frame_options']}, "
        f"CSP {'set' if b['dashboard_csp'] else 'missing'} |",
        f"| gateway kill -9 under load, restarted | every answered request has a row | serving again after "
        f"{k['restart_to_serving_s']} s; {lost['closed_as_gateway_crash']} rows closed as gateway_crash |",
        f"| whole run | 0 audit rows lost | {lost['without_closed_row']} of {lost['requests_admitted']} admitted "
        f"requests (a 200) without a closed row {lost['examples'] or ''}; {lost['open_rows_left']} rows left open; "
        f"refused requests without a row: {lost['refused_without_row']} of {lost['refused']} |",
        f"| SIGTERM with an engine frozen | exit <= timeout + 2 s | {s['took_s']} s (timeout {s['timeout_s']:g} s), "
        f"exit {s['exit']} |",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


def run_faults(a) -> dict:  # noqa: ANN001 - soak.py's argparse namespace
    if os.getuid() != 0:
        sys.exit("the fault run mounts a tmpfs for the store's full disk: run it as root")
    tmp = Path(tempfile.mkdtemp(prefix="tokenpath-faults-"))
    mnt = tmp / "store"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)], check=True)
    if a.stall_timeout is None:
        sys.path.insert(0, str(ROOT / "src"))
        from tokenpath.replica.liveness import STALL_AFTER_S

        a.stall_timeout = STALL_AFTER_S
    load_before = [round(x, 2) for x in os.getloadavg()]
    gw = Gateway(tmp, str(mnt / "gateway.sqlite3"), a)
    try:
        gw.start()
        res = asyncio.run(drive(a, gw, mnt))
    finally:
        if gw.proc is not None and gw.proc.poll() is None:
            gw.proc.kill()
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    res["load_before"], res["load_after"] = load_before, [round(x, 2) for x in os.getloadavg()]
    res["machine"] = f"{os.cpu_count()} CPUs"
    res["command"] = "benchmarks/soak.py " + " ".join(sys.argv[1:])
    write(res, a.out)
    return res
