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
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fault_load import Load, first, freeze, healthy, hello_flood, pct

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
VICTIM, OTHER = "engine-0", "engine-1"


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

    def lines(self) -> list[dict]:
        """Every JSON line the gateway logged, over its restarts."""
        out = []
        for log in sorted(self.tmp.glob("server-*.log")):
            for x in log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    if isinstance(line := json.loads(x), dict):
                        out.append(line)
        return out

    def events(self, event: str) -> list[dict]:
        return [line for line in self.lines() if line.get("event") == event]


async def freeze_phase(run: Load, gw: Gateway, a) -> dict:  # noqa: ANN001
    frozen, resumed = await freeze(gw.engine_pid(VICTIM), a.freeze)
    await asyncio.sleep(a.gap)
    normal = run.normal_s(frozen - 1)
    base = [r["dur"] for r in run.records if r["start"] < frozen - 1 and r["ok"]]
    during = [r for r in run.records if frozen <= r["start"] < resumed]
    overlapping = [r for r in run.records if r["start"] < resumed and r["start"] + r["dur"] > frozen]
    late_ids = {r["rid"] for r in during if r["start"] > frozen + a.stall_timeout + 0.5}
    received = set(re.findall(r"request (c\d+-\d+) queued", gw.engine_log(VICTIM)))
    return {
        "freeze_s": a.freeze, "stall_timeout_s": a.stall_timeout,
        "time_to_eject_s": first(run.health, frozen, lambda h: not healthy(VICTIM)(h)),
        "time_to_recover_s": first(run.health, resumed, healthy(VICTIM)),
        "ejections_logged": sum(e.get("reason") == "stalled" and e.get("replica") == VICTIM
                                for e in gw.events("replica_ejected")),
        "sent_during_freeze": len(during), "succeeded_during_freeze": sum(r["ok"] for r in during),
        "success_during_freeze": round(sum(r["ok"] for r in during) / max(1, len(during)), 4),
        "lost_overlapping_freeze": sum(not r["ok"] for r in overlapping),
        "normal_p50_s": round(normal, 3), "normal_p99_s": pct(base, 0.99),
        "worst_extra_wait_s": round(max((r["dur"] for r in overlapping), default=normal) - normal, 3),
        "routed_to_frozen_after_bound": len(late_ids & received),
    }


async def disk_phase(run: Load, gw: Gateway, a, mnt: Path) -> dict:  # noqa: ANN001
    filler = mnt / "filler"

    def fill() -> None:
        with filler.open("wb", buffering=0) as f:
            for chunk in (1 << 16, 512, 1):
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    pass

    t_fail, wall_fail = time.monotonic(), time.time()
    await asyncio.to_thread(fill)
    filled = time.monotonic() - t_fail
    await asyncio.sleep(a.disk_full)
    t_repair = time.monotonic()
    filler.unlink()
    deadline = t_repair + 120
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        last = run.health[-1] if run.health else None
        if last and last["t"] > t_repair + 0.5 and last["audit"] == "ok" and last["spool"] == 0:
            break
    spool = [h["spool"] for h in run.health if t_fail <= h["t"]]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    counts = {k: int(float(m.group(1))) for k in ("spooled", "dropped")
              if (m := re.search(rf"^tokenpath:audit_rows_{k}_total (\S+)$", metrics, re.M))}
    # When the first write failed: SQLite commits into the WAL's already allocated pages while it
    # can, so on a full disk writes go on succeeding (durably) for a while (README, "The audit log loses nothing").
    failed = next((t - wall_fail for line in gw.lines()
                   if str(line.get("msg")).startswith("audit store cannot be written")
                   and (t := dt.datetime.fromisoformat(line["time"]).timestamp()) >= wall_fail), None)
    return {"disk_full_s": a.disk_full, "fill_s": round(filled, 3),
            "first_failed_write_s": None if failed is None else round(failed, 3),
            "time_to_degraded_s": first(run.health, t_fail, lambda h: h["audit"] != "ok"),
            "max_spool_rows": max(spool, default=0), "rows_spooled_total": counts.get("spooled"),
            "rows_dropped_total": counts.get("dropped"),
            "drained_after_repair_s": first(run.health, t_repair + 0.5,
                                            lambda h: h["audit"] == "ok" and h["spool"] == 0)}


async def port_phase(run: Load, gw: Gateway) -> dict:
    import psutil

    pid = gw.engine_pid(OTHER)
    port = next(c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN)
    served = len(run.records)
    growth = await hello_flood(pid, port)
    await asyncio.sleep(3)
    return {"engine_rss_growth_mib": growth, "requests_served_meanwhile": len(run.records) - served}


async def browser_phase(gw: Gateway) -> dict:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        host = await c.get("/v1/models", headers={"Host": "evil.example"})
        xsite = await c.post("/reset_prefix_cache", content=b"", headers={"Origin": "http://evil.example",
                                                                           "Content-Type": "text/plain"})
        dash = await c.get("/dashboard")
    return {"foreign_host_status": host.status_code, "cross_site_post_status": xsite.status_code,
            "dashboard_x_frame_options": dash.headers.get("x-frame-options"),
            "dashboard_csp": bool(dash.headers.get("content-security-policy"))}


async def crash_phase(run: Load, gw: Gateway, a) -> dict:  # noqa: ANN001
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
    run = Load(lambda: gw.url)
    model = httpx.get(f"{gw.url}/v1/models", timeout=30).json()["data"][0]["id"]
    tasks = run.start(model, a.clients)
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
        f"| store's disk full {d['disk_full_s']:g} s | `/health` degraded within 1 s | {d['time_to_degraded_s']} s "
        f"after the filling began (filled in {d.get('fill_s')} s; the first write failed at "
        f"{d.get('first_failed_write_s')} s: until then SQLite commits into the WAL's allocated pages) |",
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
